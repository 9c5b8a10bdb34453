"""kill -9 of an AsyncHybrid worker of a running elastic job (`reflow run` with
cluster.workers): the job goes on with one worker fewer. Worker 1 holds a
trainer replica in the leader's group when it dies, so the step it broke is
trained again by the group that is left (no step lost or counted twice), its
engine leaves the weight-sync group, and the job SUCCEEDS with the ledger
balanced and nothing of the dead worker left running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.faults.test_kill_service import REPO, _alive, _processes_of, _records

NUM_STEPS, BATCH, KILL_AT = 16, 16, 5
SPEC = """
name: elastic-kill
mode: reflow
model: {{path: {model}}}
task: {{name: repeat, args: {{max_count: 16, num_symbols: 4}}}}
rollout: {{group_size: 4, max_tokens: 24, kv_cache_gb: 1}}
trainer: {{batch_size: {batch}, num_steps: {steps}, learning_rate: 0.001,
           batch_timeout_s: 240}}
replay: {{replay_cap: 0.5, max_staleness: 1}}
scheduler: {{placement: false}}
cluster: {{workers: 3, trainer_workers: 2}}
"""


def _worker_pid(cli: psutil.Process, port: str) -> int:
    for child in cli.children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "serve" in cmd and cmd[cmd.index("serve") + 1] == "worker" and port in cmd:
            return child.pid
    raise AssertionError(f"no worker process serving port {port}")


@pytest.mark.slow
def test_a_killed_trainer_replica_leaves_the_group_and_the_job_succeeds(tmp_path, tiny_model):
    spec = tmp_path / "elastic.yaml"
    spec.write_text(SPEC.format(model=tiny_model, batch=BATCH, steps=NUM_STEPS))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "reflow.cli", "run", str(spec), "--out",
                             str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    cli = psutil.Process(proc.pid)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    try:
        while len(_records(metrics)) < KILL_AT:
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, "the job never reached the step to kill at"
            time.sleep(0.05)
        endpoints = json.loads((out / "endpoints.json").read_text())
        victim = psutil.Process(_worker_pid(cli, endpoints["worker-1"]["grpc"].rpartition(":")[2]))
        # The worker and what it started (its vLLM engine core): all must go.
        doomed = [victim.pid] + [c.pid for c in victim.children(recursive=True)]
        descendants = {p.pid for p in cli.children(recursive=True)}
        killed_at = time.time()
        victim.send_signal(signal.SIGKILL)
        output = proc.communicate(timeout=900)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    (tmp_path / "cli.log").write_text(output)
    assert proc.returncode == 0, output[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phase"] == "SUCCEEDED", summary
    assert not [p for p in doomed if _alive(p)]
    leftovers = [p for p in descendants if _alive(p)] + _processes_of(out)
    assert not leftovers, leftovers

    events = _records(out / "scheduler_events.jsonl")
    left = [e for e in events if e.get("event") == "worker_left_pool"]
    assert len(left) == 1 and (left[0]["name"], left[0]["role"]) == ("worker-1", "trainer"), left
    assert left[0]["workers_left"] == 2
    assert not [e for e in events if e.get("event") == "service_restarted"]

    records = _records(metrics)
    # Every step once, in order, none trained again from a checkpoint; the group
    # was two replicas before the kill and the leader alone after it.
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    assert not (out / "metrics.superseded.jsonl").exists()
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert {r["trainer_workers"] for r in records[:KILL_AT]} == {2}
    # Steps begun after the kill (the one in progress may have ended just before it).
    assert {r["trainer_workers"] for r in records[KILL_AT + 1:]} == {1}
    assert all(r["trained_tokens"] > 0 for r in records)
    # The step the kill broke was trained again on the smaller group (once), and
    # the dead worker's engine left the weight-sync group.
    assert records[-1]["trainer_group_breaks"] == 1
    assert records[-1]["retired_engines"] == 1
    assert "trainer group broke" in (out / "logs" / "worker-0.log").read_text()
    last = records[-1]
    assert last["leased_samples"] == 0
    assert last["put_samples_total"] == (last["trained_unused_samples_total"]
                                         + last["evicted_unused_samples_total"]
                                         + last["unused_pool_samples"])
    first_uses = sum(r["fresh_samples"] + r["stale_samples"] for r in records)
    assert 0 <= last["trained_unused_samples_total"] - first_uses <= BATCH
    broke = [r for r in records if r["recorded_at"] > killed_at][0]
    row = {"fault": "elastic trainer replica", "killed_after_step": len(
               [r for r in records if r["recorded_at"] <= killed_at]),
           "recovery_s": round(broke["recorded_at"] - killed_at, 2), "steps_lost": 0,
           "groups_rerouted": left[0]["groups_rerouted"]}
    print(json.dumps(row))
