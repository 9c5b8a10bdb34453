"""Policy snapshots (trainer/snapshots.py, `trainer.policy_snapshot_interval`) and the
command that scores them (`reflow eval`): when one is due, that a reader sees a whole
snapshot or none, and the errors that name the field or flag to fix."""

import json

import pytest

from reflow.cli import main as cli
from reflow.core.config import JobSpecError, load_job_spec
from reflow.trainer.snapshots import SNAPSHOT_META, snapshot_due, write_snapshot


def test_a_snapshot_is_due_every_interval_but_not_at_the_last_step():
    assert [s for s in range(1, 11) if snapshot_due(3, s, 10)] == [3, 6, 9]
    assert [s for s in range(1, 5) if snapshot_due(1, s, 4)] == [1, 2, 3]  # 4: the final policy
    assert not any(snapshot_due(0, s, 10) for s in range(1, 11))


def test_a_snapshot_is_whole_or_absent(tmp_path):
    def save(path):
        path.mkdir(parents=True)
        (path / "config.json").write_text("{}")

    seconds = write_snapshot(save, tmp_path, 4, 4, "job-1")
    snapshot = tmp_path / "policies" / "step-4"
    assert isinstance(seconds, float) and (snapshot / "config.json").exists()
    assert json.loads((snapshot / SNAPSHOT_META).read_text()) == {
        "step": 4, "policy_version": 4, "job_id": "job-1"}

    def dies(path):
        path.mkdir(parents=True)
        raise OSError("disk full")

    with pytest.raises(OSError):
        write_snapshot(dies, tmp_path, 6, 6, "job-1")
    assert not (tmp_path / "policies" / "step-6").exists()  # only the .partial, never read
    # Written again (a resumed trainer): replaced, not refused.
    write_snapshot(save, tmp_path, 4, 4, "job-2")
    assert json.loads((snapshot / SNAPSHOT_META).read_text())["job_id"] == "job-2"


def test_snapshots_are_refused_for_a_sharded_trainer_by_name():
    spec = load_job_spec("examples/math_replay.yaml", ["trainer.policy_snapshot_interval=2"])
    assert spec.trainer.policy_snapshot_interval == 2
    with pytest.raises(JobSpecError, match="trainer.policy_snapshot_interval"):
        load_job_spec("examples/math_replay.yaml", ["trainer.policy_snapshot_interval=2",
                                                    "trainer.parallelism=fsdp"])
    with pytest.raises(JobSpecError, match="policy_snapshot_interval"):
        load_job_spec("examples/math_replay.yaml", ["trainer.policy_snapshot_interval=-1"])


def test_the_engine_capacity_is_a_rollout_field_every_mode_keeps():
    for mode in ("reflow", "fully_async"):
        spec = load_job_spec("examples/math_replay.yaml", [f"mode={mode}"])
        assert spec.rollout.max_num_seqs == 8
    with pytest.raises(JobSpecError, match="max_num_seqs"):
        load_job_spec("examples/math_replay.yaml", ["rollout.max_num_seqs=0"])


def test_reflow_eval_names_what_is_wrong(tmp_path, capsys):
    assert cli(["eval", "examples/math_replay.yaml", "--policy", str(tmp_path),
                "--num-prompts", "0"]) == 2
    assert "--num-prompts" in capsys.readouterr().err
    assert cli(["eval", "examples/math_replay.yaml", "--policy", str(tmp_path)]) == 2
    assert "not a model directory" in capsys.readouterr().err


class AnswerEngine:
    """Answers a held-out prompt with its correct response where the prompt's index
    is even and with nothing otherwise, as token ids of the policy's tokenizer."""

    def __init__(self, replies: dict[tuple[int, ...], list[int]]) -> None:
        self.replies, self.shut = replies, False

    async def generate(self, request_id, prompt_ids, sampling):
        from reflow.rollout.engine import TokenDelta

        ids = self.replies[tuple(prompt_ids)]
        assert sampling.temperature == 0.0  # greedy: the spec's eval settings
        yield TokenDelta(token_ids=ids, logprobs=[0.0] * len(ids), finished=True,
                         finish_reason="stop")

    def shutdown(self) -> None:
        self.shut = True


def test_a_saved_policy_is_scored_on_the_held_out_split(tiny_model, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    from reflow.rollout.policy_eval import evaluate_policy
    from reflow.rollout.service import prompt_encoder
    from reflow.tasks import build_task

    policy = tmp_path / "policies" / "step-7"
    shutil.copytree(tiny_model, policy)
    (policy / "reflow-policy.json").write_text(json.dumps({"step": 7, "policy_version": 7}))
    spec = load_job_spec("examples/quickstart.yaml", [f"model.path={policy}"])
    tokenizer = AutoTokenizer.from_pretrained(str(policy), local_files_only=True)
    task = build_task(spec, tmp_path, "eval")
    encode, _ = prompt_encoder(task, tokenizer)
    held_out = task.eval_prompts(6)
    replies, expected = {}, 0.0
    for i, p in enumerate(held_out):
        symbol, count = p.answer.split(":")  # repeat's answer: the symbol, count times
        right = " ".join([symbol] * int(count))
        ids = tokenizer.encode(right, add_special_tokens=False) if i % 2 == 0 else []
        replies[tuple(encode(p))] = ids
        expected += task.reward(p, tokenizer.decode(ids, skip_special_tokens=True)) >= 1.0
    expected /= len(held_out)
    assert expected == 0.5  # the right answers score 1, the empty ones do not
    engines = []

    def factory(spec_, path):
        assert path == policy
        engines.append(AnswerEngine(replies))
        return engines[-1]

    fields = evaluate_policy(spec, policy, tmp_path, num_prompts=6, engine_factory=factory)
    assert fields["eval_num_prompts"] == 6 and fields["eval_samples"] == 6
    assert fields["eval_errors"] == 0
    assert fields["eval_pass_at_1"] == pytest.approx(expected)
    assert fields["eval_policy_version"] == 7  # the snapshot's own version
    assert engines[0].shut  # the engine is shut down once scored
