"""What gRPC's mutual TLS costs a whole job: the quickstart, TLS on against off.

    python bench/tls_step.py --out bench/out/tls_step.json
    python bench/tls_step.py --steps 10 --repeats 1 --out /tmp/tls_step.json   # a smoke run

Each turn is a real `reflow run examples/quickstart.yaml`: by default with every
service on its own certificate from a CA minted for the run, and with
`--insecure-plaintext` for the other mode. The modes take turns `--repeats`
times (plaintext first in odd turns, TLS first in even ones), so a drift of the
machine over the benchmark lands on both. Per run, from its metrics.jsonl and
the clock:

- step: the median `step_time_s` after the first `--warmup` steps (the
  trainer's wait for its batch, the update and the weight sync; every gRPC
  call of the data path is inside it: puts, dispatch, the lease, GetStats);
- weight sync: the median `weight_sync_s` (tensors over gloo, not gRPC: a
  control figure that TLS should leave as it is);
- job: the `reflow run` command's wall time, start-up and shutdown included
  (a CA and five certificates are minted per run with TLS).

The table shows each figure's median over the repeats [min–max] and TLS over
plaintext. Benchmarks are not tests: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess  # nosec B404 - runs this repo's own CLI with a fixed argv
import sys
import tempfile
import time
from pathlib import Path

from reflow.report import read_metrics

MODES = ("plaintext", "mutual TLS")
ROOT = Path(__file__).resolve().parents[1]


def run_once(mode: str, config: Path, steps: int, warmup: int, out: Path) -> dict:
    argv = [sys.executable, "-m", "reflow.cli", "run", str(config), "--out", str(out)]
    if mode == "plaintext":
        argv.append("--insecure-plaintext")
    argv.append(f"trainer.num_steps={steps}")
    start = time.monotonic()
    done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True,  # nosec B603
                          check=False)
    job_s = time.monotonic() - start
    if done.returncode != 0:
        raise SystemExit(f"{mode}: reflow run exited {done.returncode}:\n{done.stderr[-3000:]}")
    records = read_metrics(out / "metrics.jsonl")
    steady = records[warmup:] or records
    return {"mode": mode, "run_dir": str(out), "steps": len(records), "job_s": job_s,
            "step_s": statistics.median(r["step_time_s"] for r in steady),
            "weight_sync_s": statistics.median(r["weight_sync_s"] for r in steady),
            "batch_wait_s": statistics.median(r["batch_wait_s"] for r in steady)}


FIELDS = (("step_s", "step", 1000, "ms"), ("weight_sync_s", "weight sync", 1000, "ms"),
          ("batch_wait_s", "batch wait", 1000, "ms"), ("job_s", "job", 1, "s"))


def report(runs: list[dict]) -> dict:
    summary: dict[str, dict] = {}
    for mode in MODES:
        mine = [r for r in runs if r["mode"] == mode]
        summary[mode] = {f: {"median": statistics.median(r[f] for r in mine),
                             "min": min(r[f] for r in mine), "max": max(r[f] for r in mine)}
                         for f, *_ in FIELDS}
    print("| mode | " + " | ".join(f"{label} ({unit})" for _, label, _, unit in FIELDS) + " |")
    print("|---" * (len(FIELDS) + 1) + "|")
    for mode in MODES:
        cells = []
        for f, _, scale, _ in FIELDS:
            s = summary[mode][f]
            cells.append(f"{s['median'] * scale:.0f} [{s['min'] * scale:.0f}–{s['max'] * scale:.0f}]")
        print(f"| {mode} | " + " | ".join(cells) + " |")
    ratio = {f: summary["mutual TLS"][f]["median"] / summary["plaintext"][f]["median"]
             for f, *_ in FIELDS}
    print("| TLS ÷ plaintext | " + " | ".join(f"{ratio[f]:.2f}" for f, *_ in FIELDS) + " |")
    return {"modes": summary, "tls_over_plaintext": ratio}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--config", type=Path, default=ROOT / "examples" / "quickstart.yaml")
    parser.add_argument("--steps", type=int, default=60, help="trainer steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="first steps left out of medians")
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode, alternating")
    parser.add_argument("--runs-dir", type=Path, default=None,
                        help="where the runs go (default: a temporary directory)")
    args = parser.parse_args()
    runs_dir = args.runs_dir or Path(tempfile.mkdtemp(prefix="tls-step-"))
    runs = []
    for turn in range(args.repeats):
        order = MODES if turn % 2 == 0 else tuple(reversed(MODES))
        for mode in order:
            out = runs_dir / f"{mode.replace(' ', '-')}-{turn}"
            runs.append(run_once(mode, args.config, args.steps, args.warmup, out))
            r = runs[-1]
            print(f"turn {turn} {mode}: step {r['step_s'] * 1000:.0f} ms, "
                  f"job {r['job_s']:.0f} s", flush=True)
    result = {"config": str(args.config), "steps": args.steps, "warmup": args.warmup,
              "repeats": args.repeats, "runs": runs, **report(runs)}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
