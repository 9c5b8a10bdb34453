"""The weight-sync check fails a job loudly (trainer/sync_check.py): a real job
whose engine's log-probs differ from the trainer's by more than the tolerance
ends FAILED at once, naming the engine and the version, instead of training on
samples from a policy it does not hold. Here the tolerance is set below the
two sides' rounding (about 2e-7 nats per token in float32), so the check at the
start trips on a correctly loaded engine: the same path a stale adapter takes."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.slow


def test_an_engine_off_the_trainer_s_policy_fails_the_job_naming_it(tmp_path, tiny_model):
    out = tmp_path / "run"
    run = subprocess.run(
        [sys.executable, "-m", "reflow.cli", "run", str(REPO / "examples" / "quickstart.yaml"),
         "--out", str(out), f"model.path={tiny_model}", "trainer.num_steps=3",
         "lora.rank=8", "rollout.sync_check_tolerance=1e-12"],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert run.returncode != 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phase"] == "FAILED" and summary["steps"] == 0, summary
    assert ("does not sample from the adapter the trainer published as v0"
            in run.stdout + run.stderr), run.stdout[-3000:] + run.stderr[-3000:]
    assert "rollout.sync_check_tolerance 1e-12" in run.stdout + run.stderr
