"""A whole-job resume: `reflow run` stopped mid-job (Ctrl-C), then `reflow run
--resume RUN_DIR` continues it from the checkpoint the stop wrote; and what is
not a run, or has no committed checkpoint, is refused before anything starts.
The job trains LoRA adapters, whose checkpoint holds the adapters alone (a
killed trainer's resume of full weights: test_kill_service.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
NUM_STEPS, BATCH = 40, 32


def reflow(*args, timeout=120):
    return subprocess.run([sys.executable, "-m", "reflow.cli", *args], capture_output=True,
                          text=True, cwd=REPO, timeout=timeout)


def _interruptible() -> None:
    """The run's SIGINT as a terminal gives it: a suite started in the background
    (`cmd &`, nohup) passes SIGINT on ignored, and Python keeps it ignored, so the
    Ctrl-C below would not stop the run."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def test_resume_refuses_what_it_cannot_continue_before_starting_anything(tmp_path):
    missing = reflow("run", "--resume", str(tmp_path / "nope"))
    assert missing.returncode == 2 and "no such run directory" in missing.stderr
    (tmp_path / "run" / "checkpoints" / "step-00000004").mkdir(parents=True)
    torn = reflow("run", "--resume", str(tmp_path / "run"))
    assert torn.returncode == 2 and "no committed checkpoint" in torn.stderr
    both = reflow("run", str(QUICKSTART), "--resume", str(tmp_path / "run"))
    assert both.returncode == 2 and "no config file" in both.stderr
    # Refused in the CLI's own process: no stack was started (it would write logs/).
    assert not (tmp_path / "run" / "logs").exists()


@pytest.mark.slow
def test_a_stopped_run_resumes_from_its_stop_checkpoint(tmp_path, tiny_model):
    out = tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-m", "reflow.cli", "run", str(QUICKSTART), "--out", str(out),
         f"trainer.num_steps={NUM_STEPS}", "trainer.checkpoint_interval=100",
         f"trainer.batch_size={BATCH}", f"model.path={tiny_model}", "lora.rank=8",
         "trainer.learning_rate=0.01"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True, preexec_fn=_interruptible)
    deadline = time.monotonic() + 600
    while len(_records(out / "metrics.jsonl")) < 6:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    proc.communicate(timeout=180)
    stopped = json.loads((out / "summary.json").read_text())
    assert stopped["phase"] == "STOPPED", stopped
    before = _records(out / "metrics.jsonl")
    stop_step = before[-1]["step"]
    assert 6 <= stop_step < NUM_STEPS
    # The stop itself was checkpointed (the interval, 100, never came), adapters only:
    # the base weights come from model.path again.
    stop_dir = out / "checkpoints" / f"step-{stop_step:08d}"
    assert (stop_dir / "COMMITTED").is_file()
    saved = sum(f.stat().st_size for f in stop_dir.rglob("*") if f.is_file())
    assert saved < (Path(tiny_model) / "model.safetensors").stat().st_size / 2

    resumed = reflow("run", "--resume", str(out), timeout=900)
    assert resumed.returncode == 0, resumed.stdout[-4000:] + resumed.stderr[-4000:]
    assert f"step {stop_step}" in resumed.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phase"] == "SUCCEEDED"
    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    first = records[stop_step]
    assert first["resumed_from_step"] == stop_step and first["superseded_steps"] == 0
    # The engines were re-synced to the resumed adapters and checked against them.
    assert all(r["sync_check_logprob_diff"] < 1e-3 for r in records)
    assert records[-1]["weight_sync_bytes"] == records[0]["weight_sync_bytes"]
    assert (out / "checkpoint" / "adapter" / "adapter_model.safetensors").is_file()
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    # The dispatcher continued its prompt stream and re-sent what was in flight.
    events = [e for e in _records(out / "scheduler_events.jsonl")
              if e.get("event") == "dispatch_resumed"]
    assert len(events) == 1 and events[0]["stream_position"] > 0
    # The buffer survived in the run's Redis (AOF): its ledger balances over both runs.
    last = records[-1]
    assert last["put_samples_total"] == (last["trained_unused_samples_total"]
                                         + last["evicted_unused_samples_total"]
                                         + last["unused_pool_samples"])
    assert last["put_samples_total"] > before[-1]["put_samples_total"]
    # A succeeded run has nothing to continue.
    again = reflow("run", "--resume", str(out), timeout=300)
    assert again.returncode == 2 and "only a stopped or failed job resumes" in again.stderr
