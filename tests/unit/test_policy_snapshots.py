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
    assert seconds >= 0 and (snapshot / "config.json").exists()
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
