"""Building a model preset while others ask for it too: the scheduler's job
threads prepare jobs at once, and a trainer and a rollout worker may share a
models volume. Each run starts fresh processes, so transformers is imported
for the first time by the racing threads, as in a fresh scheduler."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

# Threads that call ensure_model at the same moment; prints what each got.
RACE = """
import json, sys, threading
assert "transformers" not in sys.modules
from reflow.models.tiny import ensure_model

path, num_threads = sys.argv[1], int(sys.argv[2])
start, results = threading.Barrier(num_threads), []

def build():
    start.wait()
    try:
        results.append(str(ensure_model(path, "tiny-qwen3", seed=3)))
    except Exception as err:
        results.append(f"{type(err).__name__}: {err}")

threads = [threading.Thread(target=build) for _ in range(num_threads)]
for t in threads:
    t.start()
for t in threads:
    t.join()
print(json.dumps(results))
"""


def _race(path: Path, num_threads: int) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RACE, str(path), str(num_threads)],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
def test_threads_and_processes_building_one_preset_at_once_all_get_it(tmp_path):
    target = tmp_path / "models" / "tiny-qwen3"
    racers = [_race(target, 4), _race(target, 4)]
    results = []
    for proc in racers:
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        results += json.loads(out)
    assert results == [str(target)] * 8, results
    # One complete model, and nothing beside it (no staging directory, no lock file).
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(target, local_files_only=True)
    assert model.config.hidden_size == 128 and len(tokenizer) == model.config.vocab_size
    assert [p.name for p in target.parent.iterdir()] == ["tiny-qwen3"]
