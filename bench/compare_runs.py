"""Compare the learning curves of finished runs, step for step.

    python bench/compare_runs.py runs/a runs/b ... [--steps N] [--out FILE]

For each run directory prints the mean reward of the first 10, the last 10
and the last 50 steps and over all steps, the mean replay fraction and the
samples evicted for staleness; with --out writes the same as JSON, with the
held-out scores by version and the median step, optimisation and weight-sync
times. `--steps N`: every run's first N steps only (runs compared at the same
number of trained samples).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from reflow.report import read_metrics


def stats(run_dir: Path, steps: int | None = None) -> dict:
    records = read_metrics(run_dir / "metrics.jsonl")[:steps]
    if not records:
        raise SystemExit(f"{run_dir}: no metrics.jsonl records")
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    rewards = [r["reward_mean"] for r in records]
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    return {
        "run": str(run_dir),
        "steps": len(records),
        "reward_first10": mean(rewards[:10]),
        "reward_last10": mean(rewards[-10:]),
        "reward_last50": mean(rewards[-50:]),
        "reward_all_steps": mean(rewards),
        "replay_fraction": mean([r.get("replay_fraction", 0.0) for r in records]),
        "evicted_samples": records[-1].get("evicted_samples_total", 0),
        "trainer_tokens_per_s": sum(r["trained_tokens"] for r in records)
        / sum(r["step_time_s"] for r in records),
        # Tokens of samples trained for the first time (replay trains some again);
        # None for runs recorded before it was measured.
        "first_use_tokens_per_s": sum(r["first_use_tokens"] for r in records)
        / sum(r["step_time_s"] for r in records)
        if all("first_use_tokens" in r for r in records) else None,
        "eval_reward_by_version": {str(r["eval_policy_version"]): r["eval_reward"]
                                   for r in records if r.get("eval_reward") is not None},
        "step_time_s_median": median([r["step_time_s"] for r in records]),
        "train_s_median": median([r["train_s"] for r in records]),
        "weight_sync_s_median": median([r["weight_sync_s"] for r in records]),
        "weight_sync_bytes": records[-1].get("weight_sync_bytes"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--steps", type=int, help="compare each run's first N steps")
    parser.add_argument("--out")
    args = parser.parse_args()
    rows = [stats(r, args.steps) for r in args.runs]
    print(f"{'run':<40}{'first10':>8}{'last10':>8}{'last50':>8}{'all':>8}{'replay':>8}"
          f"{'evicted':>9}{'tok/s':>8}{'first-use tok/s':>16}")
    for r in rows:
        first = r["first_use_tokens_per_s"]
        print(f"{Path(r['run']).name:<40}{r['reward_first10']:>8.3f}{r['reward_last10']:>8.3f}"
              f"{r['reward_last50']:>8.3f}{r['reward_all_steps']:>8.3f}{r['replay_fraction']:>8.2f}"
              f"{r['evicted_samples']:>9}{r['trainer_tokens_per_s']:>8.0f}"
              f"{'-' if first is None else f'{first:.0f}':>16}")
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
