"""Trainer checkpoints: exact round trip, the commit marker, retention, refusal of
what is not a whole checkpoint, and a save killed mid-write never loaded."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap

import pytest
import torch

from reflow.trainer.checkpoint import (COMMIT_MARKER, STATE_FILE, CheckpointError, Checkpointer,
                                       check_resume_dir, committed, latest_checkpoint,
                                       load_checkpoint, read_checkpoint, supersede_metrics)


def _model_and_optimizer(path: str, seed: int = 0):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(path, local_files_only=True)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, optimizer) -> None:
    ids = torch.randint(0, model.config.vocab_size, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    optimizer.step()
    optimizer.zero_grad()


def test_round_trip_is_exact_and_the_save_is_not_torn_by_later_steps(tiny_model, tmp_path):
    model, optimizer = _model_and_optimizer(tiny_model)
    _step(model, optimizer)
    saved_params = {n: p.detach().clone() for n, p in model.named_parameters()}
    saved_moments = {k: v["exp_avg"].clone() for k, v in optimizer.state_dict()["state"].items()}
    torch.manual_seed(1234)
    expected_draw = torch.rand(3)
    torch.manual_seed(1234)
    cp = Checkpointer(tmp_path, interval=1, keep_last=2)
    cp.save(1, 7, model, optimizer, {"ledger": {"put_total": 16}})
    # Training goes on while the save is written: the checkpoint is step 1's state.
    _step(model, optimizer)
    assert cp.wait(60) is not None and cp.error == ""
    info = latest_checkpoint(tmp_path)
    assert (info.step, info.policy_version, info.state["ledger"]) == (1, 7, {"put_total": 16})
    assert cp.last["last_checkpoint_bytes"] > 0 and cp.last["last_checkpoint_write_s"] > 0

    fresh, fresh_opt = _model_and_optimizer(tiny_model, seed=99)
    load_checkpoint(info, fresh, fresh_opt)
    for name, p in fresh.named_parameters():
        assert torch.equal(p, saved_params[name]), name
    state = fresh_opt.state_dict()["state"]
    for k, moment in saved_moments.items():
        assert torch.equal(state[k]["exp_avg"], moment)
    assert float(state[0]["step"]) == 1.0
    # The RNG continues where the save left it.
    assert torch.equal(torch.rand(3), expected_draw)


def test_retention_keeps_the_last_n_and_uncommitted_directories_are_never_loaded(tiny_model,
                                                                                tmp_path):
    model, optimizer = _model_and_optimizer(tiny_model)
    _step(model, optimizer)
    cp = Checkpointer(tmp_path, interval=2, keep_last=2)
    assert [s for s in range(1, 9) if cp.due(s)] == [2, 4, 6, 8]
    for step in (2, 4, 6):
        cp.save(step, step, model, optimizer, {})
    cp.wait(60)
    root = tmp_path / "checkpoints"
    assert [p.name for p in committed(root)] == ["step-00000004", "step-00000006"]
    # A save that died before its marker: newest by number, never loaded.
    torn = root / "step-00000008"
    torn.mkdir()
    (torn / STATE_FILE).write_text(json.dumps({"format": 1, "step": 8, "policy_version": 8}))
    assert latest_checkpoint(tmp_path).step == 6
    with pytest.raises(CheckpointError, match="not committed"):
        read_checkpoint(torn)
    # The next commit removes it with the checkpoints past retention.
    cp.save(10, 10, model, optimizer, {})
    cp.wait(60)
    assert sorted(p.name for p in root.iterdir()) == ["step-00000006", "step-00000010"]


def test_resume_refuses_what_is_not_a_whole_checkpoint(tiny_model, tmp_path):
    with pytest.raises(CheckpointError, match="no such run directory"):
        check_resume_dir(tmp_path / "missing")
    with pytest.raises(CheckpointError, match="no checkpoints/ directory"):
        check_resume_dir(tmp_path)
    root = tmp_path / "checkpoints"
    (root / "step-00000003").mkdir(parents=True)
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        check_resume_dir(tmp_path)
    model, optimizer = _model_and_optimizer(tiny_model)
    _step(model, optimizer)
    cp = Checkpointer(tmp_path, interval=1, keep_last=3)
    cp.save(4, 4, model, optimizer, {})
    cp.wait(60)
    assert check_resume_dir(tmp_path).step == 4
    # A corrupt state file: refused with what to do, and never loaded.
    (root / "step-00000004" / STATE_FILE).write_text("{not json")
    with pytest.raises(CheckpointError, match="corrupt"):
        read_checkpoint(root / "step-00000004")
    with pytest.raises(CheckpointError, match="every checkpoint"):
        check_resume_dir(tmp_path)
    # Another model's checkpoint does not load into this one.
    cp.save(5, 5, model, optimizer, {})
    cp.wait(60)
    other = torch.nn.Linear(3, 3)
    with pytest.raises(CheckpointError, match="does not load"):
        load_checkpoint(read_checkpoint(root / "step-00000005"), other,
                        torch.optim.AdamW(other.parameters()))


def test_a_save_killed_mid_write_is_never_loaded(tiny_model, tmp_path):
    """kill -9 of a trainer process while its checkpoint is being written: the
    directory has no commit marker, and the previous checkpoint stays the latest."""
    script = textwrap.dedent(f"""
        import os, sys, time, torch
        import torch.distributed.checkpoint.filesystem as fs
        from transformers import AutoModelForCausalLM
        from reflow.trainer.checkpoint import Checkpointer
        model = AutoModelForCausalLM.from_pretrained({tiny_model!r})
        opt = torch.optim.AdamW(model.parameters())
        cp = Checkpointer(__import__('pathlib').Path({str(tmp_path)!r}), 1, 5)
        cp.save(1, 1, model, opt, {{}}); cp.wait(60)
        # The second save's write stalls (a slow disk) so the kill lands mid-write.
        original = fs._write_files_from_queue
        def slow(*a, **k):
            print("writing", flush=True); time.sleep(120); return original(*a, **k)
        fs._write_files_from_queue = slow
        cp.save(2, 2, model, opt, {{}})
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "writing"
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait(30)
    root = tmp_path / "checkpoints"
    assert (root / "step-00000002").is_dir()
    assert not (root / "step-00000002" / COMMIT_MARKER).exists()
    assert latest_checkpoint(tmp_path).step == 1


def test_superseded_metrics_leave_the_curve(tmp_path):
    lines = [json.dumps({"step": s, "reward_mean": s / 10}) for s in range(1, 8)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 8, "rew')
    assert supersede_metrics(tmp_path, 5) == 3
    kept = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert kept == [1, 2, 3, 4, 5]
    assert len((tmp_path / "metrics.superseded.jsonl").read_text().splitlines()) == 3


@pytest.mark.parametrize("arg", ["relative/checkpoints/step-00000004",
                                 "/run/checkpoints/../checkpoints/step-00000004",
                                 "/run/checkpoints/step-4", "/run/elsewhere/step-00000004",
                                 "/etc/passwd", ""])
def test_a_replica_refuses_a_checkpoint_directory_that_is_not_a_runs_step(arg):
    from reflow.trainer.checkpoint import check_shard_dir

    with pytest.raises(ValueError, match="is not a run's checkpoints/step-N directory"):
        check_shard_dir(arg)


def test_a_replica_that_cannot_see_the_leaders_run_directory_says_it_must_be_shared(tmp_path):
    from reflow.trainer.checkpoint import check_shard_dir

    path = tmp_path / "checkpoints" / "step-00000004"
    with pytest.raises(CheckpointError, match="which every trainer must mount"):
        check_shard_dir(str(path))
    (tmp_path / "elsewhere").mkdir()
    path.parent.mkdir()
    path.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(CheckpointError):
        check_shard_dir(str(path))  # a link out of the run directory
    path.unlink()
    path.mkdir()
    assert check_shard_dir(str(path)) == path
