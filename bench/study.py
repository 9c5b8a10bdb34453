"""A pre-registered learning comparison: run what is missing, score each run's
policies on held-out problems, keep the evidence in git, rebuild the tables.

    python bench/study.py bench/data/replay-real                 # run, then print the tables
    python bench/study.py bench/data/replay-real --analyse-only  # the tables from committed data
    python bench/study.py bench/data/replay-real --seeds 0-1     # only these seeds this time

The study directory's `study.yaml` is the pre-registration, committed before the
first run: job spec and overrides, entries, seeds, steps, the primary metric, the
points it is read at, its test, the decision rule and the replay gate. Runs are
interleaved, one at a time: seed 0 runs every entry in the file's order, then
seed 1, ..., so drift of this shared machine hits every entry alike; a run whose
committed file exists is not run again, so the study continues where it stopped,
in a later sitting or on another checkout.

Per run:
1. `reflow run` of the entry's spec with `seed=k` and
   `trainer.policy_snapshot_interval` (the run directory under bench/out/, not git's);
2. the replay gate: an entry the gate names must have trained at least
   `min_replay_fraction` replayed samples in its steady state (the mean of
   `replay_fraction` from `steady_from_step` on), else the study stops there and
   says so, before spending hours on a workload that does not replay;
3. the policy each primary point picks (study_analysis.snapshot_at: the last
   snapshot at or before the point, what a user stopping the job there holds) is
   scored with `reflow eval` on the held-out split, the initial weights once per
   study (`base-heldout.json`);
4. `<entry>/seed<k>.json`: the command, the commit, the machine's load before and
   after, the step records (bench/evidence.py) and the held-out scores; then the
   snapshots are deleted (hundreds of MB each).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess  # nosec B404 # runs reflow.cli from argv lists
import sys
import time
from pathlib import Path

import yaml

import evidence
import study_analysis as sa
from convergence import parse_seeds
from reflow.report import read_metrics

REPO = evidence.REPO


def load_study(directory: Path) -> sa.Study:
    path = directory / "study.yaml"
    if not path.is_file():
        raise SystemExit(f"{path}: no study file (the pre-registration) here")
    return sa.Study.from_yaml(directory.name, yaml.safe_load(path.read_text()) or {})


def run_overrides(study: sa.Study, entry: str, seed: int) -> list[str]:
    return [*study.overrides, *study.entries[entry], f"seed={seed}",
            f"trainer.policy_snapshot_interval={study.primary.snapshot_interval}"]


def _reflow(args: list[str], log: Path) -> tuple[int, float]:
    started = time.monotonic()
    with open(log, "a") as stream:
        result = subprocess.run([sys.executable, "-m", "reflow.cli", *args],  # nosec B603
                                stdout=stream, stderr=subprocess.STDOUT, cwd=REPO)
    return result.returncode, time.monotonic() - started


def score(study: sa.Study, overrides: list[str], policy: Path, log: Path) -> dict:
    """`reflow eval` of one policy directory; its fields and the command."""
    out = policy.parent / f"{policy.name}.eval.json"
    args = ["eval", str(REPO / study.config), *overrides, "--policy", str(policy),
            "--num-prompts", str(study.primary.num_prompts), "--out", str(out)]
    code, elapsed = _reflow(args, log)
    if code != 0:
        raise SystemExit(f"reflow eval of {policy} failed (exit {code}); see {log}")
    fields = json.loads(out.read_text())[0]
    fields.pop("policy", None)
    return {**fields, "eval_wall_s": round(elapsed, 1)}


def base_heldout(study: sa.Study, directory: Path, out: Path) -> dict:
    """The initial weights' held-out score, once per study (every run starts there)."""
    path = directory / "base-heldout.json"
    if path.exists():
        return json.loads(path.read_text())
    from reflow.core.config import load_job_spec

    spec = load_job_spec(str(REPO / study.config), [*study.overrides, "seed=0"])
    from reflow.models.tiny import ensure_model

    ensure_model(spec.model.path, spec.model.build_if_missing, seed=spec.seed)
    out.mkdir(parents=True, exist_ok=True)
    fields = score(study, [*study.overrides, "seed=0"], Path(spec.model.path), out / "base.log")
    path.write_text(json.dumps({"model": study.config, **fields}, indent=2) + "\n")
    return fields


def run_one(study: sa.Study, directory: Path, out: Path, entry: str, seed: int) -> None:
    run_dir = out / entry / f"seed{seed}"
    if run_dir.exists():
        shutil.rmtree(run_dir)  # an unfinished run: `reflow run` refuses a used directory
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    log = out / entry / f"seed{seed}.log"
    log.write_text("")
    overrides = run_overrides(study, entry, seed)
    args = ["run", str(REPO / study.config), "--out", str(run_dir), *overrides]
    print(f"== seed {seed} {entry}: reflow {' '.join(args)}", flush=True)
    before = evidence.machine()
    code, elapsed = _reflow(args, log)
    after = evidence.machine()
    if code != 0:
        raise SystemExit(f"seed {seed} {entry} failed (exit {code}); see {log}")
    records = read_metrics(run_dir / "metrics.jsonl")
    # 2. The gate: a replay study on a workload that does not replay measures nothing.
    replay = sa.steady_replay(records, study.gate.steady_from_step)
    # 3. The policies at the primary points.
    heldout = {}
    for point, value in study.primary.points.items():
        step = sa.snapshot_at(records, point, value, study.primary.snapshot_interval)
        policy = (run_dir / "policies" / f"step-{step}" if 0 < step < len(records)
                  else run_dir / "checkpoint")
        heldout[point] = {"point": value, "step": step, **sa.point_position(records, step),
                          **(score(study, overrides, policy, log) if step > 0
                             else {**base_heldout(study, directory, out), "base": True})}
    shutil.rmtree(run_dir / "policies", ignore_errors=True)
    path = evidence.write_run(
        directory, entry, seed, command=["reflow", *args], records=records, elapsed_s=elapsed,
        returncode=code, machine_before=before, machine_after=after,
        extra={"steady_replay_fraction": replay, "heldout": heldout})
    print(f"   {elapsed:.0f} s, steady replay {replay:.3f}, held-out "
          + ", ".join(f"{p} {h.get('eval_pass_at_1', float('nan')):.3f} (step {h['step']})"
                      for p, h in heldout.items()) + f"; {path.relative_to(REPO)}", flush=True)
    if entry in study.gate.entries and replay < study.gate.min_replay_fraction:
        raise SystemExit(
            f"replay gate: {entry} seed {seed} replayed {replay:.3f} of its trained samples "
            f"from step {study.gate.steady_from_step} on, below the study's "
            f"{study.gate.min_replay_fraction}: this setting does not make replay a real share "
            "of the batch on this machine; change the workload (a new study), not this one")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("study", help="the study directory, bench/data/<name>")
    parser.add_argument("--out", help="run directories (default bench/out/<name>)")
    parser.add_argument("--seeds", help="run only these of the study's seeds this time")
    parser.add_argument("--analyse-only", action="store_true", help="run nothing")
    args = parser.parse_args(argv)
    directory = Path(args.study).absolute()
    study = load_study(directory)
    out = Path(args.out).absolute() if args.out else REPO / "bench" / "out" / study.name
    if not args.analyse_only:
        seeds = parse_seeds(args.seeds) if args.seeds else study.seeds
        if set(seeds) - set(study.seeds):
            raise SystemExit(f"--seeds: {sorted(set(seeds) - set(study.seeds))} are not the "
                             f"study's ({study.seeds})")
        for seed in seeds:
            for entry in study.entries:
                if evidence.run_path(directory, entry, seed).exists():
                    print(f"== seed {seed} {entry}: committed before, kept", flush=True)
                    continue
                run_one(study, directory, out, entry, seed)
    for name, table in sa.tables(study, directory).items():
        print(f"\n<!-- table {study.name}/{name} -->\n{table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
