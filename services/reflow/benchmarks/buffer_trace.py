"""Where a reflow-mode step waits: the replay buffer's counters traced through a run.

    reflow bench trace --out bench/out/trace [--runs 2] [--steps 40]
        [--variant oldest=replay.staleness_version=oldest
         --variant completed=replay.staleness_version=completed]

Runs examples/bench_modes.yaml in reflow mode once per variant and round
(interleaved), and while each run trains polls the replay service's Stats RPC
every `--interval-s`. From the counters it derives, at every poll, the samples in
flight on the rollout workers (dispatched, not yet put), the samples leased to
the trainer, the unused and replay pools, and the room left under the two
dispatch bounds of `JobSpec.dispatch_limits` (outstanding at most B_max per step
for 1 + look-ahead steps; dispatched less evicted at most B_max per step up to
the published version plus the look-ahead). It then reports the share of the
steady state (policy versions from `--warmup-versions`) spent in each phase:

- trainer holds a batch (a lease is out), or holds none (waiting for a batch,
  or publishing between steps);
- waiting with fewer unused samples than the floor ⌈b(1-σ)⌉ (short of fresh
  samples), or with the floor met but too few replay samples to fill the batch
  (short of replay: the σ share cannot be used);
- no sample in flight on rollout (the engine has nothing to generate);
- the outstanding bound, or the version bound, leaves no room for a group.

Prints the table (median and min-max over rounds) with each run's trained
tokens/s, and writes DIR/trace.json and every run's poll log (DIR/NAME-K.jsonl).
The poller is a third process on the machine: compare variants within one
invocation, not against runs without it.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import subprocess  # nosec B404 # runs reflow.cli under sys.executable from argv lists
import sys
import time
from pathlib import Path

from reflow.core.config import JobSpec, load_job_spec

REPO = Path(__file__).resolve().parents[3]
SPEC = REPO / "examples" / "bench_modes.yaml"
PHASES = ("trainer_holds_batch", "trainer_without_batch", "short_of_fresh",
          "short_of_replay", "rollout_empty", "outstanding_bound", "version_bound")
DEFAULT_VARIANTS = ("oldest=replay.staleness_version=oldest",
                    "completed=replay.staleness_version=completed")


def phases(row: dict, spec: JobSpec) -> dict[str, bool]:
    """The phases one poll of the buffer's counters (BufferStats fields) is in."""
    batch = spec.trainer.batch_size
    group = spec.rollout.group_size
    floor = math.ceil(batch * (1.0 - spec.replay.replay_cap) - 1e-9)
    dispatched, evicted = row["dispatched_total"], row["evicted_unused_total"]
    outstanding = dispatched - row["trained_unused_total"] - evicted
    outstanding_limit, version_limit = spec.dispatch_limits(row["policy_version"])
    unused, replay = row["unused_samples"], row["replay_samples"]
    waiting = row["leased_samples"] == 0
    return {
        "trainer_holds_batch": not waiting,
        "trainer_without_batch": waiting,
        "short_of_fresh": waiting and unused < floor,
        "short_of_replay": waiting and floor <= unused < batch and unused + replay < batch,
        "rollout_empty": dispatched - row["put_total"] <= 0,
        "outstanding_bound": outstanding_limit - outstanding < group,
        "version_bound": version_limit - (dispatched - evicted) < group,
    }


def phase_shares(rows: list[dict], spec: JobSpec, warmup_versions: int) -> dict[str, float]:
    """Each phase's share of the time between polls from `warmup_versions` on; a
    poll's phases last until the next poll."""
    totals = dict.fromkeys(PHASES, 0.0)
    span = 0.0
    for row, following in zip(rows, rows[1:]):
        if row["policy_version"] < warmup_versions:
            continue
        dt = following["t"] - row["t"]
        span += dt
        for name, on in phases(row, spec).items():
            totals[name] += dt if on else 0.0
    return {name: (value / span if span > 0 else 0.0) for name, value in totals.items()}


def _wait_for(path: Path, proc: subprocess.Popen, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and proc.poll() is None:
        if path.exists() and path.stat().st_size > 0:
            return True
        time.sleep(0.05)
    return False


def _job_id(events: Path) -> str:
    for line in events.read_text().splitlines():
        job = json.loads(line).get("job_id")
        if job:
            return job
    raise RuntimeError(f"{events}: no job_id")


def trace_run(run_dir: Path, overrides: list[str], steps: int, interval_s: float,
              log: Path) -> list[dict]:
    """Run one job and poll its buffer until it ends; returns the polls."""
    from reflow.replay.client import GrpcReplayClient

    cmd = [sys.executable, "-m", "reflow.cli", "run", str(SPEC), "--out", str(run_dir),
           "mode=reflow", f"trainer.num_steps={steps}", *overrides]
    rows: list[dict] = []
    with open(log.with_suffix(".log"), "w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT)  # nosec B603
        try:
            events = run_dir / "scheduler_events.jsonl"
            if not (_wait_for(run_dir / "endpoints.json", proc, 300)
                    and _wait_for(events, proc, 300)):
                raise RuntimeError(f"run did not start; see {log.with_suffix('.log')}")
            address = json.loads((run_dir / "endpoints.json").read_text())["replay"]["grpc"]
            job_id = _job_id(events)
            client = GrpcReplayClient(address, deadline_s=5.0, retry_s=0.0)
            start = time.monotonic()
            while proc.poll() is None:
                try:
                    stats = client.stats(job_id)
                except Exception:  # noqa: BLE001 - the job is ending; its services go
                    break
                rows.append({"t": round(time.monotonic() - start, 4), **vars(stats)})
                time.sleep(interval_s)
            client.close()
            if proc.wait() != 0:
                raise RuntimeError(f"run failed; see {log.with_suffix('.log')}")
        finally:
            if proc.poll() is None:
                proc.kill()
    log.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return rows


def trained_tokens_per_s(run_dir: Path, warmup_steps: int) -> float:
    """Trained tokens over step time after the warm-up, as `reflow bench modes` counts."""
    from reflow.benchmarks.modes import summarize_mode
    from reflow.report import read_metrics

    records = read_metrics(run_dir / "metrics.jsonl")
    return summarize_mode(records, warmup_steps, target=math.inf)["trainer_tokens_per_s"]


def _summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="reflow bench trace", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--runs", type=int, default=2)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--warmup-versions", type=int, default=5)
    parser.add_argument("--interval-s", type=float, default=0.025)
    parser.add_argument("--variant", action="append", default=None,
                        help="NAME=override[;override...] (repeatable; default: "
                        "replay.staleness_version oldest and completed)")
    args = parser.parse_args(argv)
    from reflow import rpcauth

    # gRPC secrets (reflow.rpcauth): the runs started here inherit them, and this
    # process's own calls to their services carry them.
    rpcauth.ensure_local_credentials()
    variants: dict[str, list[str]] = {}
    for text in args.variant or DEFAULT_VARIANTS:
        name, _, overrides = text.partition("=")
        if not name or not name.isidentifier():
            parser.error(f"--variant {text!r}: expected NAME=override[;override...]")
        variants[name] = [o for o in overrides.split(";") if o]
    args.out.mkdir(parents=True, exist_ok=True)
    results: dict[str, dict] = {name: {"runs": []} for name in variants}
    for k in range(1, args.runs + 1):
        for name, overrides in variants.items():
            run_dir = args.out / f"{name}-{k}"
            rows = trace_run(run_dir, overrides, args.steps, args.interval_s,
                             args.out / f"{name}-{k}.jsonl")
            spec = load_job_spec(run_dir / "config.yaml")
            shares = phase_shares(rows, spec, args.warmup_versions)
            run = {"run": str(run_dir), "polls": len(rows),
                   "trained_tokens_per_s": trained_tokens_per_s(run_dir, args.warmup_versions),
                   **shares}
            results[name]["runs"].append(run)
            print(f"{name}-{k}: {run['trained_tokens_per_s']:.0f} trained tok/s, "
                  + ", ".join(f"{p} {shares[p]:.2f}" for p in PHASES), flush=True)
    columns = ("trained_tokens_per_s", *PHASES)
    for result in results.values():
        result["summary"] = {c: _summary([r[c] for r in result["runs"]]) for c in columns}
    (args.out / "trace.json").write_text(json.dumps(results, indent=2))
    print("\n| variant | " + " | ".join(columns) + " |")
    print("|---|" + "---:|" * len(columns))
    for name, result in results.items():
        cells = []
        for c in columns:
            s = result["summary"][c]
            fmt = "{:.0f}" if c == "trained_tokens_per_s" else "{:.2f}"
            cells.append(f"{fmt.format(s['median'])} [{fmt.format(s['min'])}–{fmt.format(s['max'])}]")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"\nwrote {args.out / 'trace.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
