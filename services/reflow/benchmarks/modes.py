"""The four modes side by side: sync, one_step_off, fully_async, reflow.

    python bench/modes.py --out bench/out/modes [--config examples/quickstart.yaml]
    reflow bench modes --out bench/out/modes

Runs the same job (same seed, model, task and number of trained samples) in
every mode, one after another on this machine, each through `reflow run` with
all services as separate processes. Writes DIR/results.json shaped
{mode: {trainer_tokens_per_s, wall_time_s, trainer_idle_ratio,
rollout_idle_ratio, final_reward, time_to_target_reward_s, ...}}, prints a
table with a per-stage breakdown of the trainer's step time, and plots reward
against wall-clock time for the four modes (DIR/reward_vs_time.png).

Throughput is trained tokens over step time, summed over the steps after
`--warmup` (the paper's definition, §7.2). Ratios between modes are the
figures to read: they are measured in one invocation on one machine.
"""

from __future__ import annotations

import argparse
import json
import subprocess  # nosec B404 # runs reflow.cli under sys.executable from argv lists
import sys
from pathlib import Path

MODES = ("sync", "one_step_off", "fully_async", "reflow")
REPO = Path(__file__).resolve().parents[3]


def moving_average(values: list[float], window: int) -> list[float]:
    out, acc = [], 0.0
    for i, v in enumerate(values):
        acc += v
        if i >= window:
            acc -= values[i - window]
        out.append(acc / min(i + 1, window))
    return out


def summarize_mode(records: list[dict], warmup: int, target: float, window: int = 10) -> dict:
    measured = records[warmup:] or records
    step_s = sum(r["step_time_s"] for r in measured)
    wait_s = sum(r["batch_wait_s"] for r in measured)
    sync_s = sum(r["weight_sync_s"] for r in measured)
    smoothed = moving_average([r["reward_mean"] for r in records], window)
    reached = next((r["wall_time_s"] for r, s in zip(records, smoothed)
                    if s >= target and r["step"] >= window), None)
    n = len(measured)
    return {
        "steps": len(records),
        "trainer_tokens_per_s": sum(r["trained_tokens"] for r in measured) / step_s,
        "wall_time_s": records[-1]["wall_time_s"],
        "trainer_idle_ratio": wait_s / step_s,
        "rollout_idle_ratio": sum(r["rollout_idle_ratio"] * r["step_time_s"] for r in measured) / step_s,
        "final_reward": sum(r["reward_mean"] for r in records[-window:]) / min(window, len(records)),
        "time_to_target_reward_s": reached,
        "replay_fraction": sum(r.get("replay_fraction", 0.0) for r in measured) / n,
        "max_staleness": max(r["max_staleness"] for r in records),
        "evicted_samples": records[-1].get("evicted_samples_total", 0),
        # Where a step's time goes, in seconds per step.
        "breakdown_s": {
            "wait_for_batch": wait_s / n,
            "train": (step_s - wait_s - sync_s) / n,
            "weight_sync": sync_s / n,
        },
    }


def run_mode(mode: str, config: str, out: Path, overrides: list[str]) -> list[dict]:
    run_dir = out / mode
    if run_dir.exists():
        import shutil

        shutil.rmtree(run_dir)
    cmd = [sys.executable, "-m", "reflow.cli", "run", config, "--out", str(run_dir), f"mode={mode}",
           *overrides]
    print(f"== {mode}: {' '.join(cmd[3:])}", flush=True)
    with open(out / f"{mode}.log", "w") as log:
        # argv: sys.executable -m reflow.cli run plus this script's own arguments.
        result = subprocess.run(  # nosec B603 # argv list, no shell
            cmd, stdout=log, stderr=subprocess.STDOUT)
    if result.returncode != 0:
        raise SystemExit(f"{mode} failed (exit {result.returncode}); see {out / f'{mode}.log'}")
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def plot(all_records: dict[str, list[dict]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.5))
    for mode, records in all_records.items():
        t = [r["wall_time_s"] for r in records]
        ax.plot(t, moving_average([r["reward_mean"] for r in records], 10), label=mode)
    ax.set_xlabel("wall-clock time (s)")
    ax.set_ylabel("reward (10-step moving mean)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--config", default=str(REPO / "examples" / "bench_modes.yaml"))
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--warmup", type=int, default=5, help="steps left out of throughput")
    parser.add_argument("--target-reward", type=float, default=0.3)
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="applied to every mode (e.g. trainer.num_steps=100)")
    args = parser.parse_args(argv)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    modes = [m for m in args.modes.split(",") if m]
    all_records = {m: run_mode(m, args.config, out, args.overrides) for m in modes}
    results = {m: summarize_mode(r, args.warmup, args.target_reward) for m, r in all_records.items()}
    (out / "results.json").write_text(json.dumps(results, indent=2))
    plot(all_records, out / "reward_vs_time.png")

    base = results.get("sync", {}).get("trainer_tokens_per_s")
    print(f"\n{'mode':<13}{'tok/s':>8}{'vs sync':>8}{'wall s':>8}{'idle T':>8}{'idle R':>8}"
          f"{'reward':>8}{'t→target':>9}{'replay':>8}{'wait/st':>8}{'train/st':>9}{'sync/st':>8}")
    for m, r in results.items():
        ratio = f"{r['trainer_tokens_per_s'] / base:.2f}x" if base else "-"
        ttt = f"{r['time_to_target_reward_s']:.0f}" if r["time_to_target_reward_s"] is not None else "-"
        b = r["breakdown_s"]
        print(f"{m:<13}{r['trainer_tokens_per_s']:>8.0f}{ratio:>8}{r['wall_time_s']:>8.0f}"
              f"{r['trainer_idle_ratio']:>8.2f}{r['rollout_idle_ratio']:>8.2f}{r['final_reward']:>8.3f}"
              f"{ttt:>9}{r['replay_fraction']:>8.2f}{b['wait_for_batch']:>8.2f}{b['train']:>9.2f}"
              f"{b['weight_sync']:>8.3f}")
    print(f"\nresults: {out / 'results.json'}  plot: {out / 'reward_vs_time.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
