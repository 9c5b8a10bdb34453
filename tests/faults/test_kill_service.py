"""kill -9 of one service of a running `reflow run` job: the job controller
restarts it (the trainer resumes from its last committed checkpoint, the replay
buffer is the same buffer again since its state is in Redis), and the job
SUCCEEDS with every step recorded once, the buffer's ledger balanced and
nothing left running."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

REPO = Path(__file__).resolve().parents[2]
QUICKSTART = REPO / "examples" / "quickstart.yaml"
NUM_STEPS, INTERVAL, BATCH = 24, 4, 32


def _service_pid(cli: psutil.Process, service: str) -> int | None:
    for child in cli.children(recursive=True):
        try:
            cmd = child.cmdline()
        except psutil.Error:
            continue
        if "serve" in cmd and cmd[cmd.index("serve") + 1] == service:
            return child.pid
    return None


def _redis_pid(cli: psutil.Process) -> int | None:
    for child in cli.children(recursive=True):
        try:
            if "redis-server" in " ".join(child.cmdline()):
                return child.pid
        except psutil.Error:
            continue
    return None


def _processes_of(out: Path) -> list[int]:
    """Live processes whose command line names the run directory (a Redis started
    again after the kill is not among the descendants seen before it)."""
    found = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if str(out) in " ".join(proc.info["cmdline"] or []) and _alive(proc.info["pid"]):
            found.append(proc.info["pid"])
    return found


def _records(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _start_quickstart(out: Path, tiny_model: str, *overrides: str, options=()):
    """`reflow run` of the quickstart on the tiny model into `out`; `overrides` after
    this file's own (the last of a key wins)."""
    return subprocess.Popen(
        [sys.executable, "-m", "reflow.cli", "run", str(QUICKSTART), "--out", str(out),
         *options,
         f"trainer.num_steps={NUM_STEPS}", f"trainer.checkpoint_interval={INTERVAL}",
         f"trainer.batch_size={BATCH}", f"model.path={tiny_model}",
         # A recovery that starves the trainer fails in minutes, not the default ten.
         "trainer.batch_timeout_s=240", *overrides],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        start_new_session=True)


def _run_and_kill(tmp_path, tiny_model, service: str, kill_at: int, options=()):
    """Run the quickstart, SIGKILL `service` (or "redis") once `kill_at` steps are
    recorded, and return the run directory."""
    out = tmp_path / "run"
    proc = _start_quickstart(out, tiny_model, options=options)
    cli = psutil.Process(proc.pid)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while len(_records(metrics)) < kill_at:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, "the job never reached the step to kill at"
        time.sleep(0.05)
    victim = _redis_pid(cli) if service == "redis" else _service_pid(cli, service)
    descendants = {p.pid for p in cli.children(recursive=True)}
    killed_at = time.time()
    psutil.Process(victim).send_signal(signal.SIGKILL)
    output = proc.communicate(timeout=900)[0]
    (tmp_path / "cli.log").write_text(output)
    assert proc.returncode == 0, output[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phase"] == "SUCCEEDED", summary
    assert not _alive(victim)
    leftovers = [p for p in descendants if _alive(p)] + _processes_of(out)
    assert not leftovers, leftovers
    _report(service, out, killed_at)
    return out


def _report(service: str, out: Path, killed_at: float) -> None:
    """What the fault cost, for docs/operations/faults.md's fault log: seconds from the kill to
    the next step recorded, and steps trained again. Appended as a JSON line to
    $REFLOW_FAULT_REPORT when set (a measurement, never asserted on)."""
    records = _records(out / "metrics.jsonl")
    superseded = _records(out / "metrics.superseded.jsonl")
    after = [r for r in records if r["recorded_at"] > killed_at]
    row = {"service": service, "killed_after_step": max(
               (r["step"] for r in records + superseded if r["recorded_at"] <= killed_at),
               default=0),
           "recovery_s": round(after[0]["recorded_at"] - killed_at, 2) if after else None,
           "steps_lost": len(superseded),
           "job_s": round(records[-1]["recorded_at"] - records[0]["recorded_at"], 1)}
    print(json.dumps(row))
    path = os.environ.get("REFLOW_FAULT_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(row) + "\n")


def _restarts(out: Path, service: str) -> list[dict]:
    return [e for e in _records(out / "scheduler_events.jsonl")
            if e.get("event") == "service_restarted" and e["service"] == service]


def _assert_ledger_balances(records: list[dict], superseded: list[dict]) -> None:
    """Every sample put is trained once as unused, evicted unused, or still pooled;
    none leased at the end. Each first use was trained once, in a recorded step
    (lost steps' records included); a step killed between its release and its
    record is the only one allowed to be missing."""
    last = records[-1]
    assert last["leased_samples"] == 0
    assert last["put_samples_total"] == (last["trained_unused_samples_total"]
                                         + last["evicted_unused_samples_total"]
                                         + last["unused_pool_samples"])
    assert last["dispatched_samples_total"] >= last["put_samples_total"]
    first_uses = sum(r["fresh_samples"] + r["stale_samples"] for r in records + superseded)
    assert 0 <= last["trained_unused_samples_total"] - first_uses <= BATCH


def _assert_steps_once_and_versions_rise(records: list[dict]) -> None:
    assert [r["step"] for r in records] == list(range(1, NUM_STEPS + 1))
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)


@pytest.mark.slow
def test_a_killed_trainer_resumes_from_its_checkpoint_and_the_job_succeeds(tmp_path, tiny_model):
    # A step past the second checkpoint, chosen at random (seeded): not on a boundary
    # by construction, so some steps are always lost and must be trained again.
    kill_at = random.Random(28).choice([s for s in range(2 * INTERVAL + 1, NUM_STEPS - 6)
                                        if s % INTERVAL])
    out = _run_and_kill(tmp_path, tiny_model, "trainer", kill_at)
    events = _restarts(out, "trainer")
    assert len(events) == 1, events
    restart = events[0]
    # Resumed from the last checkpoint before the kill, not from step 0.
    assert restart["exit_code"] == -signal.SIGKILL
    assert restart["resumed_step"] >= 2 * INTERVAL and restart["resumed_step"] % INTERVAL == 0
    assert restart["resumed_step"] <= kill_at
    assert restart["checkpoint"] == f"step-{restart['resumed_step']:08d}"
    # The curve continues from the checkpoint: every step once, in order, and the
    # records of the lost steps moved aside.
    records = _records(out / "metrics.jsonl")
    _assert_steps_once_and_versions_rise(records)
    superseded = _records(out / "metrics.superseded.jsonl")
    assert all(r["step"] > restart["resumed_step"] for r in superseded)
    resumed = records[restart["resumed_step"]]
    assert resumed["resumed_from_step"] == restart["resumed_step"]
    assert resumed["superseded_steps"] == len(superseded)
    assert len(superseded) >= kill_at - restart["resumed_step"]
    _assert_ledger_balances(records, superseded)
    # The final weights were saved.
    assert (out / "checkpoint" / "config.json").exists()


@pytest.mark.slow
def test_a_killed_replay_buffer_comes_back_and_no_step_is_lost(tmp_path, tiny_model):
    out = _run_and_kill(tmp_path, tiny_model, "replay", kill_at=INTERVAL + 2)
    events = _restarts(out, "replay")
    assert len(events) == 1 and events[0]["exit_code"] == -signal.SIGKILL, events
    assert not _restarts(out, "trainer")
    records = _records(out / "metrics.jsonl")
    _assert_steps_once_and_versions_rise(records)
    assert not (out / "metrics.superseded.jsonl").exists()
    _assert_ledger_balances(records, [])


@pytest.mark.slow
def test_a_killed_rollout_worker_is_replaced_and_its_groups_go_out_again(tmp_path, tiny_model):
    out = _run_and_kill(tmp_path, tiny_model, "rollout", kill_at=INTERVAL + 2)
    events = _restarts(out, "rollout")
    assert len(events) == 1 and events[0]["exit_code"] == -signal.SIGKILL, events
    assert not _restarts(out, "trainer")
    lost = [e for e in _records(out / "scheduler_events.jsonl") if e.get("event") == "worker_lost"]
    assert len(lost) == 1 and lost[0]["groups_rerouted"] == events[0]["groups_rerouted"]
    records = _records(out / "metrics.jsonl")
    # The trainer kept its weights and steps: nothing is trained again, and the new
    # engine got the trained weights as a resync (versions still rise).
    _assert_steps_once_and_versions_rise(records)
    assert not (out / "metrics.superseded.jsonl").exists()
    _assert_ledger_balances(records, [])


@pytest.mark.slow
def test_a_killed_redis_comes_back_from_its_append_only_file_and_nothing_is_lost(tmp_path,
                                                                                 tiny_model):
    """`reflow run`'s Redis is started again on its port and loads its append-only
    file; fsynced before each acknowledgement (`always`), it lost nothing, and the
    buffer's, the dispatcher's and the scheduler's clients ride the gap out on their
    retries: no service restarts, no step is trained again. (Under `everysec` a
    crash on a busy disk can lose up to ~2 s of them: docs/operations/faults.md.)"""
    out = _run_and_kill(tmp_path, tiny_model, "redis", kill_at=INTERVAL + 2,
                        options=("--redis-appendfsync", "always"))
    assert "embedded redis exited" in (tmp_path / "cli.log").read_text()
    assert not [e for e in _records(out / "scheduler_events.jsonl")
                if e.get("event") == "service_restarted"]
    records = _records(out / "metrics.jsonl")
    _assert_steps_once_and_versions_rise(records)
    assert not (out / "metrics.superseded.jsonl").exists()
    _assert_ledger_balances(records, [])


def _kill_trainers(proc, cli, out: Path, kills: int, ready) -> list[float]:
    """SIGKILL `kills` successive trainer processes of the job, each once
    `ready(pid, kill_times)` says so; returns when each was killed."""
    killed: list[float] = []
    last_pid = None
    deadline = time.monotonic() + 600
    while len(killed) < kills:
        assert proc.poll() is None, proc.communicate()[0][-4000:]
        assert time.monotonic() < deadline, f"only {len(killed)} of {kills} kills in time"
        pid = _service_pid(cli, "trainer")
        if pid is not None and pid != last_pid and ready(pid, killed):
            psutil.Process(pid).send_signal(signal.SIGKILL)
            killed.append(time.time())
            last_pid = pid
        time.sleep(0.05)
    return killed


@pytest.mark.slow
def test_more_trainer_deaths_than_the_budget_spread_over_the_window_succeed(tmp_path,
                                                                            tiny_model):
    """Four trainer kills, each more than cluster.restart_window_s after the last and
    each after the restarted trainer recorded a step: one over the default budget
    (3) as a lifetime count, none a crash loop. The job succeeds, every step once."""
    window_s, kills = 5.0, 4
    out = tmp_path / "run"
    proc = _start_quickstart(out, tiny_model, "trainer.num_steps=48",
                             f"cluster.restart_window_s={window_s}")
    cli = psutil.Process(proc.pid)
    seen: dict[int, int] = {}

    def ready(pid: int, killed: list[float]) -> bool:
        # Progress under this trainer process (a step recorded since it started), and
        # the last kill out of the window.
        steps = len(_records(out / "metrics.jsonl"))
        seen.setdefault(pid, steps)
        return (steps > seen[pid] + 1 and steps >= 2 * INTERVAL
                and (not killed or time.time() - killed[-1] > window_s + 1))

    killed = _kill_trainers(proc, cli, out, kills, ready)
    output = proc.communicate(timeout=900)[0]
    assert proc.returncode == 0, output[-4000:]
    assert json.loads((out / "summary.json").read_text())["phase"] == "SUCCEEDED"
    restarts = _restarts(out, "trainer")
    assert len(restarts) == kills, restarts
    records = _records(out / "metrics.jsonl")
    assert [r["step"] for r in records] == list(range(1, 49))
    _assert_ledger_balances(records, _records(out / "metrics.superseded.jsonl"))
    gaps = [round(b - a, 1) for a, b in zip(killed, killed[1:])]
    print(json.dumps({"trainer_kills": kills, "seconds_between_kills": gaps,
                      "restart_s": [e["restart_s"] for e in restarts]}))


@pytest.mark.slow
def test_a_trainer_dying_in_a_tight_loop_fails_the_job_fast_naming_the_crash_loop(tmp_path,
                                                                                  tiny_model):
    """Each new trainer process is killed as soon as it is up: with
    cluster.max_restarts=2 the third death inside the window fails the job, its
    reason naming the crash loop, after two restarts (the second backed off). A
    trainer killed while it starts counts as a death too, at once, not after the
    restart's health timeout."""
    out = tmp_path / "run"
    proc = _start_quickstart(out, tiny_model, "cluster.max_restarts=2",
                             "cluster.restart_backoff_s=1")
    cli = psutil.Process(proc.pid)
    descendants: set[int] = set()

    def ready(pid: int, killed: list[float]) -> bool:
        descendants.update(p.pid for p in cli.children(recursive=True))
        return len(_records(out / "metrics.jsonl")) >= 2 or bool(killed)

    killed = _kill_trainers(proc, cli, out, 3, ready)
    output = proc.communicate(timeout=600)[0]
    failed_at = time.time()
    assert proc.returncode != 0, output[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phase"] == "FAILED", summary
    assert "crash loop: trainer died 3 times within 600 s" in summary["reason"], summary
    assert "cluster.max_restarts=2" in summary["reason"], summary
    # Two restarts: each either came up and was killed, or was killed while starting.
    attempts = [e for e in _records(out / "scheduler_events.jsonl")
                if e.get("event") in ("service_restarted", "service_died_starting")
                and e["service"] == "trainer"]
    assert len(attempts) == 2, attempts
    assert not [p for p in descendants if _alive(p)] + _processes_of(out)
    print(json.dumps({"first_kill_to_failed_s": round(failed_at - killed[0], 1)}))
