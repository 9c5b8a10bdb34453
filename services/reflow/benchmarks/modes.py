"""The four modes side by side, on two workloads, several runs each.

    reflow bench modes --out bench/out/modes [--runs 3] [--workloads balanced,rollout_bound]
    python bench/modes.py --out bench/out/modes

Runs the same job (same seed, model, task and number of trained samples) as
every entry: the baselines sync, one_step_off and fully_async as their authors
run them (see MODE_PRESETS in reflow.core.config), sync_split (sync with
rollout and trainer on their own cores instead of colocated), reflow with the
paper's settings (a partially rolled-out group counting as the version it
completed under), reflow_newest and reflow_oldest (the same with
`replay.staleness_version=newest` or `oldest`, the choice the paper leaves
open),
reflow_static (the same without adaptive generation scheduling: the
ablation of paper §6.1, `scheduler.adaptive=false`), and fully_async_sync4 and
reflow_sync4 (weights synced every 4 steps, verl's fully_async recipe). Ratios
("vs sync") are against the faster of sync and sync_split in the same round.
Each entry runs through `reflow run` with all services as separate processes.

Workloads (the default: the first two):
- `balanced`: examples/bench_modes.yaml as written;
- `rollout_bound`: the paper's regime, where generation is most of a sync step
  (a longer Zipf tail of response lengths). The table prints the measured share;
- `math`: a real model, examples/math.yaml (SmolLM2-135M-Instruct on one-digit
  arithmetic, its chat template, math-verify) at a size that fits a session:
  16 samples a step, 64 response tokens, 20 steps. On this CPU the real model
  is training-bound, so this one shows what a scheduler does where generation is
  the smaller part of a step.

Runs are interleaved (round 1 runs every entry once, then round 2, ...), so a
slow minute on this shared machine hits every entry alike, and ratios against
sync are taken within a round. Writes DIR/results.json:
{workload: {"generation_share_of_sync_step": {...}, "entries": {entry: {"runs": [...],
"median": {...}, "min": {...}, "max": {...}}}}}, and prints, per workload, the
median and min-max of throughput, its ratio to sync, trainer idle, rollout
utilisation, replay fraction and final reward (at the same number of trained
samples in every entry).

Throughput is trained tokens over the wall time between consecutive step ends,
summed over the steps after `--warmup` (the paper's definition, §7.2).

`--with-trl` adds a `trl` entry to every workload and round: TRL's GRPOTrainer on
the same job (bench/trl_grpo.py, in the environment `make bench-trl-env` builds;
REFLOW_TRL_PYTHON names another interpreter), and a "vs trl" column. Time to the
target reward counts from each entry's first training step (ReFlow's trainer loop
start; TRL's train() start), so neither one's start-up is in it; start-up is in
each run's summary.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess  # nosec B404 # runs reflow.cli under sys.executable from argv lists
import sys
from pathlib import Path

MODES = ("sync", "one_step_off", "fully_async", "reflow")
# entry -> (mode, extra overrides, extra environment)
ENTRIES: dict[str, tuple[str, list[str], dict[str, str]]] = {
    **{m: (m, [], {}) for m in MODES},
    # sync disaggregated (rollout and trainer on their own cores): on a CPU box the
    # colocated hybrid engine can be the slower of the two, so ratios are taken
    # against whichever sync placement was faster in that round.
    "sync_split": ("sync", [], {"REFLOW_COLOCATE": "0"}),
    "reflow_newest": ("reflow", ["replay.staleness_version=newest"], {}),
    # A group counts as its members' oldest segment (every sample's lag within δ),
    # against the default: the version its last member finished under.
    "reflow_oldest": ("reflow", ["replay.staleness_version=oldest"], {}),
    # Weights synced every 4 steps, not every step: verl's fully_async recipes run
    # `async_training.trigger_parameter_sync_step=4`, and the paper syncs "every few
    # training steps" (§4.1 step 4). δ counts versions, so its window spans 4 steps.
    "fully_async_sync4": ("fully_async", ["trainer.sync_interval=4"], {}),
    "reflow_sync4": ("reflow", ["trainer.sync_interval=4"], {}),
    # The adaptive generation scheduler's ablation (paper §6.1): a static cap of
    # rollout.max_inflight_samples, no token-budget admission.
    "reflow_static": ("reflow", ["scheduler.adaptive=false"], {}),
}
SYNC_ENTRIES = ("sync", "sync_split")
# workload -> overrides on the config. rollout_bound: counts up to 320 on a Zipf tail
# and room for 256 tokens, so generation of a batch is dominated by its stragglers.
WORKLOADS: dict[str, list[str]] = {
    "balanced": ["trainer.num_steps=40"],
    "rollout_bound": ["task.args.max_count=320", "rollout.max_tokens=256", "trainer.num_steps=25"],
    "math": ["trainer.num_steps=20", "trainer.batch_size=16", "rollout.max_tokens=64",
             "eval.interval=0"],
}
DEFAULT_WORKLOADS = ("balanced", "rollout_bound")
# A workload on a job of its own instead of --config.
WORKLOAD_CONFIGS = {"math": "examples/math.yaml"}
REPO = Path(__file__).resolve().parents[3]
TRL_ENTRY = "trl"
TRL_SCRIPT = REPO / "bench" / "trl_grpo.py"


def trl_python() -> Path:
    """The interpreter of TRL's own environment (its transformers pin is not ours)."""
    python = Path(os.environ.get("REFLOW_TRL_PYTHON", REPO / "bench" / ".venv-trl" / "bin" / "python"))
    if not python.exists():
        raise SystemExit(f"--with-trl: no TRL environment at {python}; build it with "
                         "`make bench-trl-env` or set REFLOW_TRL_PYTHON")
    return python


def moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def _train_breakdown(measured: list[dict], rest_s: float) -> dict[str, float]:
    """A step's time besides its waits and its sync, per step: the optimisation and,
    where the trainer timed it (`train_s`), the bookkeeping around it apart (the
    lease's and release's round trips, the stats calls behind the metrics)."""
    n = len(measured)
    if not all("train_s" in r for r in measured):
        return {"train": rest_s / n}
    train_s = sum(r["train_s"] for r in measured)
    return {"train": train_s / n, "step_bookkeeping": (rest_s - train_s) / n}


def summarize_mode(records: list[dict], warmup: int, target: float, window: int = 10) -> dict:
    measured = records[warmup:] or records
    step_s = sum(r["step_time_s"] for r in measured)
    wait_s = sum(r["batch_wait_s"] for r in measured)
    sync_s = sum(r["weight_sync_s"] for r in measured)
    # The part of the weight sync spent waiting for the rollout workers to pause (their
    # samples in flight finishing, with partial rollout off): idle, as a batch wait is.
    sync_wait_s = sum(r.get("sync_wait_s", 0.0) for r in measured)
    smoothed = moving_average([r["reward_mean"] for r in records], window)
    reached = next((r["wall_time_s"] for r, s in zip(records, smoothed)
                    if s >= target and r["step"] >= window), None)
    n = len(measured)
    return {
        "steps": len(records),
        "trainer_tokens_per_s": sum(r["trained_tokens"] for r in measured) / step_s,
        # Of those, the tokens of samples trained for the first time (replay trains
        # some again); None for runs recorded before this was measured.
        "first_use_tokens_per_s": sum(r["first_use_tokens"] for r in measured) / step_s
        if all("first_use_tokens" in r for r in measured) else None,
        # Tokens the engines generated per second over the same steps (None for runs
        # recorded before this was measured, and for TRL).
        "generation_tokens_per_s": sum(r["generated_tokens"] for r in measured) / step_s
        if all("generated_tokens" in r for r in measured) else None,
        "wall_time_s": records[-1]["wall_time_s"],
        "trainer_idle_ratio": (wait_s + sync_wait_s) / step_s,
        "rollout_idle_ratio": sum(r["rollout_idle_ratio"] * r["step_time_s"] for r in measured) / step_s,
        # Not measured where no record has it (TRL has no separate engine).
        "rollout_utilisation": sum(r["rollout_utilisation"] * r["step_time_s"] for r in measured)
        / step_s if all("rollout_utilisation" in r for r in measured) else None,
        "trained_samples": sum(r["fresh_samples"] + r["stale_samples"] + r["replay_samples"]
                               for r in records),
        "final_reward": sum(r["reward_mean"] for r in records[-window:]) / min(window, len(records)),
        "time_to_target_reward_s": reached,
        "replay_fraction": sum(r.get("replay_fraction", 0.0) for r in measured) / n,
        "max_staleness": max(r["max_staleness"] for r in records),
        "evicted_samples": records[-1].get("evicted_samples_total", 0),
        # Start-up, outside throughput and time to target (TRL has no separate engine).
        "engine_startup_s": records[0].get("engine_startup_s"),
        "trainer_startup_s": records[0].get("trainer_startup_s"),
        # Evicted before any training: rollouts generated for nothing.
        "wasted_samples": records[-1].get("evicted_unused_samples_total", 0),
        # Where a step's time goes, in seconds per step.
        "breakdown_s": {
            "wait_for_batch": wait_s / n,
            **_train_breakdown(measured, step_s - wait_s - sync_s),
            "wait_for_rollout_pause": sync_wait_s / n,
            "weight_sync": (sync_s - sync_wait_s) / n,
        },
    }


def run_entry(entry: str, workload: str, run: int, config: str, out: Path,
              overrides: list[str]) -> list[dict]:
    run_dir = out / workload / f"{entry}-{run}"
    if workload in WORKLOAD_CONFIGS:
        config = str(REPO / WORKLOAD_CONFIGS[workload])
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    if entry == TRL_ENTRY:
        cmd = [str(trl_python()), str(TRL_SCRIPT), config, "--out", str(run_dir),
               *WORKLOADS[workload], *overrides]
        env: dict[str, str] = {}
    else:
        mode, extra, env = ENTRIES[entry]
        cmd = [sys.executable, "-m", "reflow.cli", "run", config, "--out", str(run_dir),
               f"mode={mode}", *WORKLOADS[workload], *extra, *overrides]
    print(f"== {workload} {entry} run {run}: {' '.join(cmd[1:])}", flush=True)
    log_path = out / workload / f"{entry}-{run}.log"
    with open(log_path, "w") as log:
        # argv: sys.executable -m reflow.cli run plus this script's own arguments.
        result = subprocess.run(  # nosec B603 # argv list, no shell
            cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env})
    if result.returncode != 0:
        raise SystemExit(f"{workload} {entry} failed (exit {result.returncode}); see {log_path}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


SPREAD_FIELDS = ("trainer_tokens_per_s", "first_use_tokens_per_s", "generation_tokens_per_s",
                 "vs_sync", "vs_trl", "time_to_target_reward_s", "trainer_idle_ratio",
                 "rollout_utilisation",
                 "replay_fraction", "final_reward", "max_staleness", "evicted_samples",
                 "wasted_samples", "wall_time_s", "engine_startup_s", "trainer_startup_s")


def spread(runs: list[dict]) -> dict:
    """Median, min and max of every numeric field over the runs; a field some run
    lacks has no median; for the time to the target reward, the count of runs that
    never reached it says so."""
    out: dict = {"median": {}, "min": {}, "max": {}, "missing_runs": {}}
    for field in SPREAD_FIELDS:
        values = [r[field] for r in runs if r.get(field) is not None]
        if field == "time_to_target_reward_s" and len(values) < len(runs):
            # A median over the runs that reached a target would flatter the entry.
            out["missing_runs"][field] = len(runs) - len(values)
        elif values:
            out["median"][field] = statistics.median(values)
            out["min"][field], out["max"][field] = min(values), max(values)
    return out


def plot(all_records: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_n) = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for name, records in all_records.items():
        t = [r["wall_time_s"] for r in records]
        smoothed = moving_average([r["reward_mean"] for r in records], 10)
        ax.plot(t, smoothed, label=name)
        # Trained samples so far: every step trains one batch of the same size.
        samples, total = [], 0
        for r in records:
            total += r.get("fresh_samples", 0) + r.get("stale_samples", 0) + r.get(
                "replay_samples", 0)
            samples.append(total)
        ax_n.plot(samples, smoothed, label=name)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("reward (10-step moving mean)")
    ax_n.set_xlabel("trained samples")
    for a in (ax, ax_n):
        a.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _cell(entry: dict, field: str, fmt: str) -> str:
    if field not in entry["median"]:
        missing = entry.get("missing_runs", {}).get(field)
        return f"none in {missing} runs" if missing else "-"
    med, lo, hi = entry["median"][field], entry["min"][field], entry["max"][field]
    return f"{med:{fmt}} [{lo:{fmt}}-{hi:{fmt}}]"


def print_table(workload: str, result: dict) -> None:
    share = result["generation_share_of_sync_step"]
    print(f"\n{workload}: generation is {share['median']:.0%} of a sync step "
          f"(min {share['min']:.0%}, max {share['max']:.0%}); median [min-max] of "
          f"{len(next(iter(result['entries'].values()))['runs'])} runs")
    columns = (("tok/s", "trainer_tokens_per_s", ".0f"), ("vs sync", "vs_sync", ".2f"),
               ("first-use tok/s", "first_use_tokens_per_s", ".0f"),
               ("gen tok/s", "generation_tokens_per_s", ".0f"),
               ("idle T", "trainer_idle_ratio", ".2f"), ("util R", "rollout_utilisation", ".2f"),
               ("replay", "replay_fraction", ".2f"), ("reward", "final_reward", ".3f"),
               ("stale", "max_staleness", ".0f"), ("wasted", "wasted_samples", ".0f"),
               ("t to target (s)", "time_to_target_reward_s", ".0f"))
    if any("vs_trl" in summary["median"] for summary in result["entries"].values()):
        columns = columns[:2] + (("vs trl", "vs_trl", ".2f"),) + columns[2:]
    print(f"{'entry':<14}" + "".join(f"{name:>22}" for name, _, _ in columns))
    for entry, summary in result["entries"].items():
        print(f"{entry:<14}" + "".join(f"{_cell(summary, field, fmt):>22}"
                                       for _, field, fmt in columns))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--config", default=str(REPO / "examples" / "bench_modes.yaml"))
    parser.add_argument("--entries", default=",".join(ENTRIES),
                        help=f"comma-separated, of {', '.join(ENTRIES)}")
    parser.add_argument("--workloads", default=",".join(DEFAULT_WORKLOADS),
                        help=f"comma-separated, of {', '.join(WORKLOADS)}")
    parser.add_argument("--runs", type=int, default=3, help="runs of every entry (interleaved)")
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of throughput")
    parser.add_argument("--target-reward", type=float, default=0.3)
    parser.add_argument("--with-trl", action="store_true",
                        help="add TRL's GRPOTrainer on the same job as entry `trl`")
    parser.add_argument("--from-runs", action="store_true",
                        help="summarise the runs already in --out instead of running them")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="applied to every entry (e.g. trainer.num_steps=100)")
    args = parser.parse_args(argv)
    out = Path(args.out).absolute()
    entries = [e for e in args.entries.split(",") if e]
    if args.with_trl:
        if not args.from_runs:
            trl_python()  # fail before the first run, not after an hour
        entries.append(TRL_ENTRY)
    workloads = [w for w in args.workloads.split(",") if w]
    for name, known in (("entries", ENTRIES), ("workloads", WORKLOADS)):
        unknown = set(entries if name == "entries" else workloads) - set(known) - {TRL_ENTRY}
        if unknown:
            raise SystemExit(f"--{name}: unknown {sorted(unknown)}; choose from {list(known)}")
    if not set(SYNC_ENTRIES) & set(entries):
        raise SystemExit("--entries must include sync or sync_split: ratios are taken against it")
    results: dict = {}
    for workload in workloads:
        (out / workload).mkdir(parents=True, exist_ok=True)
        runs: dict[str, list[dict]] = {e: [] for e in entries}
        last_records: dict[str, list[dict]] = {}
        for run in range(1, args.runs + 1):
            for entry in entries:
                if args.from_runs:
                    records = [json.loads(line) for line in (
                        out / workload / f"{entry}-{run}" / "metrics.jsonl").read_text().splitlines()]
                else:
                    records = run_entry(entry, workload, run, args.config, out, args.overrides)
                runs[entry].append(summarize_mode(records, args.warmup, args.target_reward))
                last_records[entry] = records
            # Against the faster sync placement of this round.
            base = max(runs[e][-1]["trainer_tokens_per_s"] for e in SYNC_ENTRIES if e in runs)
            trl = runs[TRL_ENTRY][-1]["trainer_tokens_per_s"] if TRL_ENTRY in runs else None
            for entry in entries:
                runs[entry][-1]["vs_sync"] = runs[entry][-1]["trainer_tokens_per_s"] / base
                if trl:
                    runs[entry][-1]["vs_trl"] = runs[entry][-1]["trainer_tokens_per_s"] / trl
        # In sync the trainer waits exactly while a batch is generated.
        shares = [r["breakdown_s"]["wait_for_batch"] / sum(r["breakdown_s"].values())
                  for e in SYNC_ENTRIES if e in runs for r in runs[e]]
        results[workload] = {
            "generation_share_of_sync_step": {"median": statistics.median(shares),
                                              "min": min(shares), "max": max(shares)},
            "entries": {e: {"runs": runs[e], **spread(runs[e])} for e in entries},
        }
        (out / "results.json").write_text(json.dumps(results, indent=2))
        plot(last_records, out / workload / "reward_vs_time.png")
    for workload, result in results.items():
        print_table(workload, result)
    print(f"\nresults: {out / 'results.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
