from pathlib import Path

import pytest

from reflow.core.config import JobSpecError, apply_overrides, load_job_spec, parse_job_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = sorted((REPO / "examples").glob("*.yaml"))


def _minimal(**extra):
    return {"model": {"path": "/models/x"}, **extra}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_config_validates(path):
    spec = load_job_spec(path)
    assert Path(spec.model.path).is_absolute()


def test_unknown_field_is_named():
    with pytest.raises(JobSpecError) as err:
        parse_job_spec(_minimal(trainer={"batch_sise": 8}))
    assert "trainer.batch_sise" in str(err.value)
    assert "unknown field" in str(err.value)


def test_negative_batch_size_is_named_with_its_bound():
    with pytest.raises(JobSpecError) as err:
        parse_job_spec(_minimal(trainer={"batch_size": -4}))
    assert "trainer.batch_size" in str(err.value)
    assert "greater than or equal to 1" in str(err.value)


def test_batch_must_hold_whole_groups():
    with pytest.raises(JobSpecError) as err:
        parse_job_spec(_minimal(trainer={"batch_size": 12}, rollout={"group_size": 8}))
    assert "multiple of rollout.group_size" in str(err.value)


def test_overrides_are_typed_and_at_most_three_deep():
    data = apply_overrides(_minimal(), ["trainer.learning_rate=1e-4", "trainer.num_steps=7",
                                        "model.build_if_missing=null", "name=abc"])
    spec = parse_job_spec(data)
    assert spec.trainer.learning_rate == pytest.approx(1e-4)
    assert spec.trainer.num_steps == 7
    assert spec.model.build_if_missing is None
    assert spec.name == "abc"
    with pytest.raises(JobSpecError, match="at most section.field"):
        apply_overrides(_minimal(), ["a.b.c.d=1"])
    # A plug-in's arguments are the one third level: section.args.name.
    spec = parse_job_spec(apply_overrides(_minimal(), ["task.args.max_count=16"]))
    assert spec.task.args == {"max_count": 16}
    with pytest.raises(JobSpecError, match="task.args.bogus"):
        parse_job_spec(apply_overrides(_minimal(), ["task.args.bogus=1"]))
    with pytest.raises(JobSpecError, match="dotted.key=value"):
        apply_overrides(_minimal(), ["trainer.num_steps"])


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_an_example_names_the_same_model_through_reflow_run_and_rest(path):
    """`reflow run` resolves the spec's model path on this machine; `reflow submit`
    sends it as written and the scheduler takes it under its models root. Both
    must land on the same directory (a relative path once resolved to the current
    directory locally and to root/.reflow/models/... over REST)."""
    from reflow.core.paths import PathRoots

    local = load_job_spec(path)
    submitted = load_job_spec(path, resolve_model_path=False)
    assert not Path(submitted.model.path).is_absolute()
    assert PathRoots.from_env().model_dir(submitted.model.path) == Path(local.model.path)
