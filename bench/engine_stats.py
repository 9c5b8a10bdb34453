"""What the rollout engine's queue metrics cost: the same job with vLLM
scheduler stats on (the default) and off (REFLOW_ENGINE_STATS=0), alternating,
side by side in one run.

    python bench/engine_stats.py [--steps 80] [--repeats 2] [--out bench/out/engine_stats]

Prints a table of trainer throughput (trained tokens over step time, steps
after the first 20) and wall time per run, the on/off ratio of the means, and
writes the same as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

from reflow.report import read_metrics

REPO = Path(__file__).resolve().parents[1]
WARMUP_STEPS = 20


def run(out: Path, steps: int, stats_on: bool) -> dict:
    env = {**os.environ, "REFLOW_ENGINE_STATS": "1" if stats_on else "0"}
    cmd = [sys.executable, "-m", "reflow.cli", "run", str(REPO / "examples" / "quickstart.yaml"),
           "--out", str(out), f"trainer.num_steps={steps}"]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, stdout=subprocess.DEVNULL)
    records = read_metrics(out / "metrics.jsonl")[WARMUP_STEPS:]
    return {
        "engine_stats": stats_on,
        "run": str(out),
        "trainer_tokens_per_s": sum(r["trained_tokens"] for r in records)
        / sum(r["step_time_s"] for r in records),
        # Of those, the tokens of samples trained for the first time.
        "first_use_tokens_per_s": sum(r["first_use_tokens"] for r in records)
        / sum(r["step_time_s"] for r in records),
        "wall_time_s": records[-1]["wall_time_s"],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--out", default="bench/out/engine_stats")
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for i in range(args.repeats):
        for stats_on in (True, False):
            rows.append(run(out / f"{'on' if stats_on else 'off'}-{i}", args.steps, stats_on))
    mean = lambda on: sum(r["trainer_tokens_per_s"] for r in rows if r["engine_stats"] is on) / args.repeats  # noqa: E731
    ratio = mean(True) / mean(False)
    print(f"{'engine stats':<14}{'trainer tok/s':>14}{'first-use tok/s':>16}{'wall s':>9}")
    for r in rows:
        print(f"{'on' if r['engine_stats'] else 'off':<14}{r['trainer_tokens_per_s']:>14.0f}"
              f"{r['first_use_tokens_per_s']:>16.0f}{r['wall_time_s']:>9.1f}")
    print(f"on/off throughput ratio: {ratio:.3f}")
    (out / "engine_stats.json").write_text(json.dumps({"runs": rows, "on_off_ratio": ratio}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
