"""A job whose trainer group is FSDP-sharded (trainer.parallelism: fsdp), run
through `reflow run`: two trainer workers each shard the model, every step is
trained over both, each version reaches the engines gathered from the shards,
each checkpoint holds both ranks' shards, and the final export is the whole
model. A run stopped after a checkpoint resumes from it, every rank loading its
shards. (A 2-rank checkpoint loading into 3 ranks: tests/integration/
test_fsdp_trainer.py.)"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.faults.test_kill_service import REPO, _records

pytestmark = pytest.mark.slow

SPEC = {
    "name": "fsdp-job", "mode": "reflow",
    "task": {"name": "repeat", "args": {"max_count": 16, "num_symbols": 4}},
    "rollout": {"group_size": 4, "max_tokens": 16, "kv_cache_gb": 1},
    "trainer": {"batch_size": 8, "num_steps": 8, "learning_rate": 0.001,
                "checkpoint_interval": 2, "parallelism": "fsdp", "batch_timeout_s": 240},
    "replay": {"max_staleness": 1},
    "scheduler": {"placement": False},
    "cluster": {"workers": 3, "trainer_workers": 2},
}


def _run(args: list[str]) -> str:
    proc = subprocess.run([sys.executable, "-m", "reflow.cli", "run", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    return proc.stdout


def _run_until_checkpoint(spec: Path, out: Path, step: int) -> None:
    """`reflow run` stopped (SIGTERM, a graceful stop) once checkpoint `step` committed."""
    proc = subprocess.Popen([sys.executable, "-m", "reflow.cli", "run", str(spec), "--out",
                             str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    marker = out / "checkpoints" / f"step-{step:08d}" / "COMMITTED"
    deadline = time.monotonic() + 600
    try:
        while not marker.exists():
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "no checkpoint in time"
            time.sleep(0.1)
        proc.send_signal(signal.SIGTERM)
        output = proc.communicate(timeout=300)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    assert json.loads((out / "summary.json").read_text())["phase"] == "STOPPED", output[-3000:]


def test_an_fsdp_job_trains_sharded_checkpoints_its_shards_and_resumes(tmp_path, tiny_model):
    from transformers import AutoModelForCausalLM

    spec = tmp_path / "fsdp.yaml"
    spec.write_text(yaml.safe_dump({**SPEC, "model": {"path": tiny_model}}))
    out = tmp_path / "run"
    _run_until_checkpoint(spec, out, 4)
    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records][:4] == [1, 2, 3, 4]
    assert {r["trainer_workers"] for r in records} == {2}
    versions = [r["policy_version"] for r in records]
    assert versions == list(range(1, len(records) + 1))  # every step published
    # A batch whose rewards are all equal (the tiny random model scores 0 on most
    # samples) has zero advantages and no gradient; the others do.
    assert all(r["trained_tokens"] > 0 for r in records)
    assert any(r["grad_norm"] > 0 for r in records), records
    leader_log = (out / "logs" / "worker-0.log").read_text()
    assert "fsdp trainer group epoch 1: 2 ranks" in leader_log
    # Each checkpoint holds a shard file of each rank and says it is sharded.
    saved = out / "checkpoints" / "step-00000004"
    assert sorted(p.name for p in saved.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]
    assert json.loads((saved / "state.json").read_text())["sharded"] is True

    # Resumed: every rank loads its shards of the checkpoint, and the job goes on.
    _run(["--resume", str(out)])
    assert json.loads((out / "summary.json").read_text())["phase"] == "SUCCEEDED"
    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 9))
    resumed = next(r for r in records if "resumed_from_step" in r)
    start = resumed["resumed_from_step"]
    assert start >= 4 and resumed["step"] == start + 1
    assert {r["trainer_workers"] for r in records[start:]} == {2}
    assert len(list((out / "checkpoints" / "step-00000008").glob("*.distcp"))) == 2
    # The export is the whole trained model, gathered from the shards.
    exported = AutoModelForCausalLM.from_pretrained(out / "checkpoint")
    initial = AutoModelForCausalLM.from_pretrained(tiny_model)
    pairs = list(zip(exported.parameters(), initial.parameters()))
    assert len(pairs) == len(list(initial.parameters()))
    assert max(float((a - b).detach().abs().max()) for a, b in pairs) > 0
