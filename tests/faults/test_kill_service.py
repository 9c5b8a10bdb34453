"""kill -9 of services of a running `reflow run` job, one at a time: the job
controller restarts each (the trainer resumes from its last committed checkpoint, the replay
buffer is the same buffer again since its state is in Redis), and the job
SUCCEEDS with every step recorded once, the buffer's ledger balanced and
nothing left running."""

from __future__ import annotations

import json
import os
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


def _run_and_kill(tmp_path, tiny_model, kills: list[tuple[str, int]], options=()):
    """Run the quickstart, SIGKILL each `(service, step)` of `kills` in turn (a
    service's name or "redis") once `step` steps are recorded, and return the run
    directory once the job has succeeded with nothing left running."""
    out = tmp_path / "run"
    proc = _start_quickstart(out, tiny_model, options=options)
    cli = psutil.Process(proc.pid)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    victims, descendants, killed = [], set(), []
    for service, kill_at in kills:
        while len(_records(metrics)) < kill_at:
            assert proc.poll() is None, proc.communicate()[0][-4000:]
            assert time.monotonic() < deadline, f"the job never reached step {kill_at}"
            time.sleep(0.05)
        victim = _redis_pid(cli) if service == "redis" else _service_pid(cli, service)
        descendants |= {p.pid for p in cli.children(recursive=True)}
        killed.append((service, time.time()))
        psutil.Process(victim).send_signal(signal.SIGKILL)
        victims.append(victim)
    output = proc.communicate(timeout=900)[0]
    (tmp_path / "cli.log").write_text(output)
    assert proc.returncode == 0, output[-4000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["phase"] == "SUCCEEDED", summary
    assert not [v for v in victims if _alive(v)]
    leftovers = [p for p in descendants if _alive(p)] + _processes_of(out)
    assert not leftovers, leftovers
    for service, killed_at in killed:
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
def test_the_replay_buffer_the_rollout_worker_and_redis_killed_in_turn_lose_nothing(
        tmp_path, tiny_model):
    """One job, three faults, each after the job recovered from the last:
    - the replay buffer is restarted at its address and is the same buffer (its
      state is in Redis): nothing else restarts;
    - the rollout worker is restarted from model.path, its groups in flight go out
      again under their ids, the trainer rebuilds weight sync and sends it the
      trained weights as a resync (versions still rise);
    - `reflow run`'s Redis is started again on its port and loads its append-only
      file; fsynced before each acknowledgement (`always`), it lost nothing, and the
      buffer's, the dispatcher's and the scheduler's clients ride the gap out on
      their retries. (Under `everysec` a crash on a busy disk can lose up to ~2 s of
      them: docs/operations/faults.md.)
    The trainer kept its weights and steps throughout: no step is trained again."""
    out = _run_and_kill(tmp_path, tiny_model,
                        [("replay", INTERVAL + 2), ("rollout", 3 * INTERVAL),
                         ("redis", 4 * INTERVAL + 2)],
                        options=("--redis-appendfsync", "always"))
    restarts = [e for e in _records(out / "scheduler_events.jsonl")
                if e.get("event") == "service_restarted"]
    assert sorted(e["service"] for e in restarts) == ["replay", "rollout"], restarts
    assert all(e["exit_code"] == -signal.SIGKILL for e in restarts), restarts
    rollout = _restarts(out, "rollout")[0]
    lost = [e for e in _records(out / "scheduler_events.jsonl") if e.get("event") == "worker_lost"]
    assert len(lost) == 1 and lost[0]["groups_rerouted"] == rollout["groups_rerouted"]
    assert "embedded redis exited" in (tmp_path / "cli.log").read_text()
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
    versions = [r["policy_version"] for r in records]
    assert versions == sorted(versions) and len(set(versions)) == len(versions)
    superseded = _records(out / "metrics.superseded.jsonl")
    # Each restart resumed from the newest committed checkpoint, not from step 0;
    # the steps after it were trained again, their first records moved aside.
    for restart in restarts:
        assert restart["exit_code"] == -signal.SIGKILL
        # Killed at step 2 x INTERVAL or later: a checkpoint had committed (the one
        # that step started may still have been writing).
        assert restart["resumed_step"] >= INTERVAL and restart["resumed_step"] % INTERVAL == 0
        assert restart["checkpoint"] == f"step-{restart['resumed_step']:08d}"
        assert records[restart["resumed_step"]]["resumed_from_step"] == restart["resumed_step"]
    # Each resume counts what it moved aside in its first record, which a later
    # resume may have moved aside in turn.
    assert sum(r.get("superseded_steps", 0) for r in records + superseded) == len(superseded)
    _assert_ledger_balances(records, superseded)
    assert (out / "checkpoint" / "config.json").exists()  # the final weights were saved
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
