"""kill -9 of AsyncHybrid workers of a running elastic job (`reflow run` with
cluster.workers: 3, two of them training). First worker 0, which holds trainer
rank 0: it is restarted and resumes from its newest checkpoint, and the replica
of worker 1, which stood by when its group broke, joins the new leader's group.
Then worker 1: the job goes on without it; the step its death broke is trained
again by the leader alone (no step lost or counted twice there), and its engine
leaves the weight-sync group. The job SUCCEEDS, every step recorded once, the
ledger balanced and nothing of either dead worker left running."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import psutil
import pytest

from tests.faults.test_kill_service import REPO, _alive, _processes_of, _records

NUM_STEPS, BATCH, INTERVAL = 18, 16, 4
KILL_LEADER_AT, KILL_REPLICA_AT = 6, 12
SPEC = """
name: elastic-kill
mode: reflow
model: {{path: {model}}}
task: {{name: repeat, args: {{max_count: 16, num_symbols: 4}}}}
rollout: {{group_size: 4, max_tokens: 24, kv_cache_gb: 1}}
trainer: {{batch_size: {batch}, num_steps: {steps}, learning_rate: 0.001,
           batch_timeout_s: 240, checkpoint_interval: {interval}}}
replay: {{replay_cap: 0.5, max_staleness: 1}}
scheduler: {{placement: false}}
cluster: {{workers: 3, trainer_workers: 2}}
"""


def _worker(cli: psutil.Process, port: str) -> psutil.Process:
    for child in cli.children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "serve" in cmd and cmd[cmd.index("serve") + 1] == "worker" and port in cmd:
            return child
    raise AssertionError(f"no worker process serving port {port}")


def _kill_at(proc, cli, out, name: str, steps: int) -> tuple[float, list[int]]:
    """SIGKILL worker `name` once `steps` steps are recorded; returns the time and
    the pids of it and what it started (its engine core), which must all go."""
    deadline = time.monotonic() + 600
    while len(_records(out / "metrics.jsonl")) < steps:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"the job never reached step {steps}"
        time.sleep(0.05)
    port = json.loads((out / "endpoints.json").read_text())[name]["grpc"].rpartition(":")[2]
    victim = _worker(cli, port)
    doomed = [victim.pid] + [c.pid for c in victim.children(recursive=True)]
    killed_at = time.time()
    victim.send_signal(signal.SIGKILL)
    return killed_at, doomed


def _succeeded(proc, tmp_path, doomed: list[int]) -> None:
    """The job `reflow run` runs in `proc` ends SUCCEEDED, with nothing left of the
    workers killed (`doomed`)."""
    try:
        output = proc.communicate(timeout=900)[0]
    finally:
        if proc.poll() is None:
            proc.kill()
    (tmp_path / "cli.log").write_text(output)
    assert proc.returncode == 0, output[-4000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["phase"] == "SUCCEEDED", summary
    assert not [p for p in doomed if _alive(p)]


@pytest.mark.slow
def test_killed_elastic_workers_are_restarted_or_left_behind_and_the_job_succeeds(tmp_path,
                                                                                  tiny_model):
    spec = tmp_path / "elastic.yaml"
    spec.write_text(SPEC.format(model=tiny_model, batch=BATCH, steps=NUM_STEPS,
                                interval=INTERVAL))
    out = tmp_path / "run"
    proc = subprocess.Popen([sys.executable, "-m", "reflow.cli", "run", str(spec), "--out",
                             str(out)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    cli = psutil.Process(proc.pid)
    try:
        leader_killed, doomed = _kill_at(proc, cli, out, "worker-0", KILL_LEADER_AT)
        replica_killed, more = _kill_at(proc, cli, out, "worker-1", KILL_REPLICA_AT)
        doomed += more
        descendants = {p.pid for p in cli.children(recursive=True)}
    except BaseException:
        proc.kill()
        raise
    _succeeded(proc, tmp_path, doomed)
    leftovers = [p for p in descendants if _alive(p)] + _processes_of(out)
    assert not leftovers, leftovers

    events = _records(out / "scheduler_events.jsonl")
    restarts = [e for e in events if e.get("event") == "service_restarted"]
    assert [(e["worker"], e["service"]) for e in restarts] == [("worker-0", "trainer")], restarts
    resumed = restarts[0]["resumed_step"]
    assert resumed >= INTERVAL and resumed % INTERVAL == 0 and resumed <= KILL_LEADER_AT
    left = [e for e in events if e.get("event") == "worker_left_pool"]
    assert [(e["name"], e["role"]) for e in left] == [("worker-1", "trainer")], left
    assert left[0]["workers_left"] == 2

    records = _records(out / "metrics.jsonl")
    superseded = _records(out / "metrics.superseded.jsonl")
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    assert all(r["step"] > resumed for r in superseded)
    assert len(superseded) >= KILL_LEADER_AT - resumed
    assert records[resumed]["resumed_from_step"] == resumed
    # Two ranks before the leader died and again under the restarted leader (the
    # replica re-joined); the leader alone once worker 1 was lost (steps begun
    # after that kill; the one in progress may have ended just before it).
    by_step = {r["step"]: r for r in records}
    assert {by_step[s]["trainer_workers"] for s in range(1, resumed + 1)} == {2}
    assert {by_step[s]["trainer_workers"]
            for s in range(resumed + 1, KILL_REPLICA_AT + 1)} == {2}
    assert {by_step[s]["trainer_workers"]
            for s in range(KILL_REPLICA_AT + 2, NUM_STEPS + 1)} == {1}
    assert all(r["trained_tokens"] > 0 for r in records)
    # The step worker 1's death broke was trained again on the smaller group (once),
    # and its engine left the weight-sync group.
    assert records[-1]["trainer_group_breaks"] == 1
    assert records[-1]["retired_engines"] == 1
    last = records[-1]
    assert last["leased_samples"] == 0
    assert last["put_samples_total"] == (last["trained_unused_samples_total"]
                                         + last["evicted_unused_samples_total"]
                                         + last["unused_pool_samples"])
    first_uses = sum(r["fresh_samples"] + r["stale_samples"] for r in records + superseded)
    assert 0 <= last["trained_unused_samples_total"] - first_uses <= BATCH

    def next_step_s(killed_at):
        return round(min(r["recorded_at"] for r in records if r["recorded_at"] > killed_at)
                     - killed_at, 2)

    print(json.dumps({"leader_recovery_s": next_step_s(leader_killed),
                      "leader_steps_lost": len(superseded), "resumed_step": resumed,
                      "replica_recovery_s": next_step_s(replica_killed),
                      "replica_steps_lost": 0,
                      "groups_rerouted": left[0]["groups_rerouted"]}))
