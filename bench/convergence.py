"""Does replay or asynchrony keep model quality? Learning curves of several entries
over paired seeds, with intervals wide enough to say when two entries differ.

An entry is a name, a base job spec (YAML) and dotted overrides: `sync: mode=sync`,
`reflow: mode=reflow`, `reflow_recompute: mode=reflow algorithm.proximal=recompute
algorithm.importance_mode=truncate`. An entry named `trl` (or `trl_*`) runs TRL's
GRPOTrainer on the same spec and overrides (bench/trl_grpo.py, in bench/.venv-trl:
`make bench-trl-env`; REFLOW_TRL_PYTHON names another interpreter). Seed k sets the
job's `seed` for every entry alike: the prompt order (the task is seeded with it) and
the sampling seed (vLLM's engine; TRL's `seed`). Runs are interleaved, one at a time:
seed 0 runs every entry in turn, then seed 1, ..., so drift of this shared machine hits
every entry alike. A run whose metrics.jsonl already holds every step is not run
again, so an interrupted benchmark continues where it stopped.

The tiny model: the quickstart's job as examples/bench_modes.yaml writes it (the same
model, task, rollout and trainer; examples/quickstart.yaml itself sets replay fields that
`mode=sync` refuses). 8 seeds x 3 entries, 80 steps of 64 samples, a held-out evaluation
every 20 versions, target reward 0.2:

    .venv/bin/python bench/convergence.py --out bench/out/convergence-tiny \
        --config examples/bench_modes.yaml --seeds 0-7 --target-reward 0.2 \
        --entry sync:mode=sync --entry reflow:mode=reflow \
        --entry reflow_recompute:mode=reflow,algorithm.proximal=recompute,algorithm.importance_mode=truncate \
        trainer.num_steps=80 eval.interval=20

Measured (2 cores shared with other jobs, load average about 5): one sync run of 60
steps took 97 s from process start to exit, 60 s of it training steps (0.89 s a step,
median) and 37 s start-up and shutdown (engine start 14 s); 3-step runs took 42-61 s in
both sync and reflow. So a sync run of 80 steps takes about 37 + 80 x 0.89 = 110 s on a
loaded machine and 75 s on a quiet one (bench/RESULTS.md: 0.44 s a sync step); reflow's
steps are shorter. 24 runs: 30-45 minutes. The smoothed sync reward passed 0.2 near
step 55-60 of that run (0.19-0.26 in its last 10 steps): 0.2 is a target most seeds reach
in 80 steps, 0.3 (the modes benchmark's, over 100 steps) one few would.

SmolLM2-135M-Instruct on one-digit arithmetic (examples/math.yaml; the dataset is made
once, as the example's header says), 4 seeds x sync, fully_async, reflow and TRL, at the
modes benchmark's math size (16 samples a step, 64 response tokens), 12 steps, a
held-out evaluation every 4 versions (v0, v4, v8, v12), target reward 0.25:

    reflow datasets export-gym basic_arithmetic --size 2000 \
        --out .reflow/datasets/arithmetic.jsonl --config '{"min_terms": 2, "max_terms": 2,
        "min_digits": 1, "max_digits": 1, "operators": ["+", "-", "*"],
        "allow_parentheses": false, "allow_negation": false}'
    make bench-trl-env
    .venv/bin/python bench/convergence.py --out bench/out/convergence-math \
        --config examples/math.yaml --seeds 0-3 --target-reward 0.25 \
        --entry sync:mode=sync --entry fully_async:mode=fully_async \
        --entry reflow:mode=reflow --entry trl: \
        trainer.num_steps=12 trainer.batch_size=16 rollout.max_tokens=64 eval.interval=4

About 60 minutes, estimated (not measured) from bench/RESULTS.md ("The real-model
workload", round 1): a step of 16 samples took 14.4 s in sync, 16.8 s in fully_async,
16.5 s in reflow and 8.9 s in TRL (wait + train + sync), 56.6 s for the four, so 12 steps
take 680 s a seed. Each ReFlow run adds its start-up and shutdown, 37 s measured on the
tiny model, taken as 50 s for the real one (three runs: 150 s), TRL's about 25 s (13 s
measured on the tiny model, plus loading the real one), and the last held-out evaluation
of each ReFlow run (the others run beside training) about 10 s (30 s): 885 s, 15 minutes
a seed, 59 minutes for 4; this machine's 15-20 % swings between hours make it 68-71, still
inside 75. 14 steps would be 67 minutes expected and over 75 in a slow hour. The first run
also imports the model from its GGUF file once. In those 20-step runs the reward passed 0.3
after 124-222 s (steps 9-14): 0.25 leaves room for 12 steps.

The plan can also come from a YAML file (`--plan FILE`; keys config, overrides, seeds,
reference, target_reward, entries: {name: [overrides] or {config, overrides, engine}});
every run's plan is written to DIR/plan.json, which `--analyse-only` rereads when no
entries are given.

What it reports (DIR/convergence.json holds all of it, DIR/convergence.png the curves):
- reward_mean against (a) trained samples (cumulative batch samples, replays included),
  (b) first-use samples (cumulative fresh + stale samples: those trained for the first
  time), and first-use tokens where every run's records carry `first_use_tokens`
  (per step, summed here),
  (c) wall time (wall_time_s: from each run's first training step, start-up excluded).
  Each run's step rewards are smoothed by a trailing mean over `--smooth-steps` steps
  (fewer at the start), interpolated linearly on a grid of `--grid-points` points
  over the range every seed of the entry covers (never extrapolated), and averaged
  over seeds with a 95 % t-interval (Student's t, n - 1 degrees of freedom).
- Held-out reward (records with `eval_reward`, eval.interval > 0) by policy version,
  at the versions every seed evaluated; same mean and band. TRL runs evaluate nothing.
- Time to the target reward: the first wall time the smoothed curve reaches it, once
  the trailing window is full; the median over seeds (a seed that never reaches it
  counts as infinite) with a percentile bootstrap interval, and how many seeds reached it.
- Each entry against the reference (`--reference`, default sync) at equal first-use
  samples, over the range every run of the plan covers: the mean of the unsmoothed
  reward curve over the last `--final-fraction` of that range, and its mean over the
  whole range (the area under the curve divided by the range); the paired difference
  seed by seed, with the paired t-interval over seeds (the convention of every learning
  table; the percentile bootstrap is printed beside it, labelled, and is too narrow at a
  handful of seeds). Where both evaluated, the same for the held-out reward at the last
  common version and averaged over the common versions. A comparison whose tables are
  quoted as results is a pre-registered study instead (bench/study.py): its runs are
  committed and its tables rebuilt from them (bench/convergence_report.py --check).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess  # nosec B404 # runs reflow.cli and bench/trl_grpo.py from argv lists
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import yaml

import convergence_stats as cs
from convergence_report import AXES, json_safe, plot, print_table
from reflow.benchmarks.modes import TRL_SCRIPT, trl_python
from reflow.report import read_metrics

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Entry:
    name: str
    overrides: list[str] = field(default_factory=list)
    config: str = ""  # empty: the plan's
    engine: str = "reflow"  # or "trl"


@dataclass
class Plan:
    config: str
    entries: list[Entry]
    seeds: list[int]
    overrides: list[str] = field(default_factory=list)  # every entry's, before its own
    reference: str = "sync"
    target_reward: float = 0.3

    def config_of(self, entry: Entry) -> str:
        return entry.config or self.config

    def overrides_of(self, entry: Entry, seed: int) -> list[str]:
        # The entry's own win over the common ones; the seed is the benchmark's.
        return [*self.overrides, *entry.overrides, f"seed={seed}"]


# --- the plan -----------------------------------------------------------------


def parse_seeds(text: str | list) -> list[int]:
    """`0-7`, `0,2,5` or `0-3,8` (or a YAML list) -> sorted distinct seeds."""
    if isinstance(text, list):
        return sorted({int(s) for s in text})
    seeds: set[int] = set()
    for part in str(text).split(","):
        lo, _, hi = part.strip().partition("-")
        seeds.update(range(int(lo), int(hi or lo) + 1))
    return sorted(seeds)


def entry_engine(name: str) -> str:
    return "trl" if name == "trl" or name.startswith("trl_") else "reflow"


def parse_entry(text: str) -> Entry:
    """`name:override,override` (`trl:` for TRL on the plan's spec as it is)."""
    name, sep, rest = text.partition(":")
    if not sep or not name:
        raise SystemExit(f"--entry {text!r}: write NAME:override,override (e.g. sync:mode=sync)")
    return Entry(name, [o for o in rest.split(",") if o], engine=entry_engine(name))


def plan_from_yaml(data: dict) -> Plan:
    entries = []
    for name, value in (data.get("entries") or {}).items():
        if isinstance(value, dict):
            entries.append(Entry(name, list(value.get("overrides", [])), value.get("config", ""),
                                 value.get("engine", entry_engine(name))))
        else:
            entries.append(Entry(name, list(value or []), engine=entry_engine(name)))
    return Plan(config=data.get("config", ""), entries=entries,
                seeds=parse_seeds(data.get("seeds", "0")),
                overrides=list(data.get("overrides", [])),
                reference=data.get("reference", "sync"),
                target_reward=float(data.get("target_reward", 0.3)))


def build_plan(args: argparse.Namespace, out: Path) -> Plan:
    if args.plan:
        plan = plan_from_yaml(yaml.safe_load(Path(args.plan).read_text()) or {})
    elif args.analyse_only and not args.entry and (out / "plan.json").exists():
        saved = json.loads((out / "plan.json").read_text())
        saved["entries"] = [Entry(**e) for e in saved["entries"]]
        plan = Plan(**saved)
    else:
        plan = Plan(config="", entries=[], seeds=[0])
    by_name = {e.name: e for e in plan.entries}
    for text in args.entry:
        entry = parse_entry(text)
        by_name[entry.name] = entry  # the command line's wins over the file's
    plan.entries = list(by_name.values())
    # Runs start in the repository root (where `.reflow/models` is): specs by absolute path.
    plan.config = str(Path(args.config or plan.config or REPO / "examples" / "bench_modes.yaml")
                      .absolute())
    for entry in plan.entries:
        entry.config = str(Path(entry.config).absolute()) if entry.config else ""
    if args.seeds:
        plan.seeds = parse_seeds(args.seeds)
    plan.overrides = [*plan.overrides, *args.overrides]
    plan.reference = args.reference or plan.reference
    if args.target_reward is not None:
        plan.target_reward = args.target_reward
    if not plan.entries:
        raise SystemExit("no entries: give --entry NAME:overrides (several) or --plan FILE")
    if plan.reference not in by_name:
        raise SystemExit(f"--reference {plan.reference!r} is not an entry "
                         f"({', '.join(by_name)})")
    for entry in plan.entries:
        if entry.engine not in ("reflow", "trl"):
            raise SystemExit(f"entry {entry.name}: engine must be reflow or trl")
        if any(o.startswith("seed=") for o in [*plan.overrides, *entry.overrides]):
            raise SystemExit(f"entry {entry.name}: seed is set by --seeds, not by an override")
    return plan


def expected_steps(plan: Plan) -> dict[tuple[str, int], int]:
    """Every (entry, seed)'s spec validated before anything runs, and its step count:
    a run is complete when its metrics.jsonl holds that many steps."""
    from reflow.core.config import JobSpecError, load_job_spec

    steps = {}
    for entry in plan.entries:
        for seed in plan.seeds:
            try:
                spec = load_job_spec(plan.config_of(entry), plan.overrides_of(entry, seed))
            except (JobSpecError, FileNotFoundError) as err:
                raise SystemExit(f"entry {entry.name}: {err}") from None
            steps[entry.name, seed] = spec.trainer.num_steps
    return steps


# --- running ------------------------------------------------------------------


def run_dir(out: Path, entry: str, seed: int) -> Path:
    return out / entry / f"seed{seed}"


def complete_records(path: Path, steps: int) -> list[dict] | None:
    """The run's step records if it finished (every step recorded), else None."""
    try:
        records = read_metrics(path / "metrics.jsonl")
    except ValueError:  # a line cut short by a crash
        return None
    if len(records) < steps or records[-1].get("step", 0) < steps:
        return None
    return records


def run_one(plan: Plan, entry: Entry, seed: int, out: Path) -> None:
    path = run_dir(out, entry.name, seed)
    if path.exists():
        shutil.rmtree(path)  # an unfinished run: `reflow run` refuses a used directory
    overrides = plan.overrides_of(entry, seed)
    if entry.engine == "trl":
        cmd = [str(trl_python()), str(TRL_SCRIPT), plan.config_of(entry), "--out", str(path),
               *overrides]
    else:
        cmd = [sys.executable, "-m", "reflow.cli", "run", plan.config_of(entry),
               "--out", str(path), *overrides]
    print(f"== seed {seed} {entry.name}: {' '.join(cmd[1:])}", flush=True)
    log = out / entry.name / f"seed{seed}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with open(log, "w") as stream:
        result = subprocess.run(cmd, stdout=stream, stderr=subprocess.STDOUT,  # nosec B603
                                cwd=REPO)
    elapsed = time.monotonic() - started
    (out / entry.name / f"seed{seed}.json").write_text(json.dumps(
        {"command": cmd, "elapsed_s": elapsed, "returncode": result.returncode}, indent=2))
    if result.returncode != 0:
        raise SystemExit(f"seed {seed} {entry.name} failed (exit {result.returncode}); see {log}")
    print(f"   {elapsed:.0f} s", flush=True)


def run_plan(plan: Plan, steps: dict[tuple[str, int], int], out: Path) -> None:
    if any(e.engine == "trl" for e in plan.entries):
        trl_python()  # fail before the first run, not after an hour
    for seed in plan.seeds:  # interleaved: every entry once per seed
        for entry in plan.entries:
            if complete_records(run_dir(out, entry.name, seed), steps[entry.name, seed]):
                print(f"== seed {seed} {entry.name}: done before, kept", flush=True)
                continue
            run_one(plan, entry, seed, out)


# --- analysis -----------------------------------------------------------------


@dataclass
class Run:
    seed: int
    reward: np.ndarray  # per step, unsmoothed
    smoothed: np.ndarray
    x: dict[str, np.ndarray]  # axis -> per step, cumulative where a count
    evals: dict[int, float]  # policy version -> held-out reward
    elapsed_s: float | None  # the whole process, start-up included
    offpolicy: dict[str, float]  # per-run means of the off-policy figures (cs.OFFPOLICY)


def load_run(records: list[dict], seed: int, smooth: int, elapsed_s: float | None) -> Run:
    def column(name: str) -> np.ndarray:
        return np.array([float(r.get(name, 0)) for r in records])

    first_use = column("fresh_samples") + column("stale_samples")
    x = {"trained_samples": np.cumsum(first_use + column("replay_samples")),
         "first_use_samples": np.cumsum(first_use),
         "wall_time_s": column("wall_time_s")}
    if all("first_use_tokens" in r for r in records):  # per step, as trained_tokens
        x["first_use_tokens"] = np.cumsum(column("first_use_tokens"))
    reward = column("reward_mean")
    evals = {int(r["eval_policy_version"]): float(r["eval_reward"])
             for r in records if "eval_reward" in r}
    return Run(seed, reward, cs.trailing_mean(reward, smooth), x, evals, elapsed_s,
               cs.offpolicy_means(records))


def load_runs(plan: Plan, steps: dict, out: Path, smooth: int) -> tuple[dict, dict]:
    """entry -> [Run] of its finished seeds; entry -> seeds not (yet) finished."""
    runs: dict[str, list[Run]] = {}
    missing: dict[str, list[int]] = {}
    for entry in plan.entries:
        runs[entry.name] = []
        for seed in plan.seeds:
            path = run_dir(out, entry.name, seed)
            records = complete_records(path, steps[entry.name, seed])
            if records is None:
                missing.setdefault(entry.name, []).append(seed)
                continue
            timing = out / entry.name / f"seed{seed}.json"
            elapsed = json.loads(timing.read_text())["elapsed_s"] if timing.exists() else None
            runs[entry.name].append(load_run(records, seed, smooth, elapsed))
    return runs, missing


def interval(values: list[float]) -> dict[str, float]:
    mean, lo, hi = cs.t_interval(np.array(values))
    return {"mean": float(mean), "low": float(lo), "high": float(hi), "num_seeds": len(values)}


def _spread(values: list[float]) -> dict[str, float] | None:
    return {"mean": float(np.mean(values)), "min": min(values), "max": max(values)} \
        if values else None


def curves(runs: list[Run], grid_points: int) -> dict:
    """Per axis every run has: the grid and the band of the smoothed rewards."""
    out = {}
    for axis in AXES:
        if not all(axis in r.x for r in runs):
            continue
        grid = cs.common_grid([r.x[axis] for r in runs], grid_points)
        if grid.size:
            ys = np.array([cs.interpolate(r.x[axis], r.smoothed, grid) for r in runs])
            out[axis] = {"grid": grid.tolist(), **cs.band(ys)}
        else:  # one seed's run ended before another's first step (short runs)
            out[axis] = None
    return out


def held_out(runs: list[Run]) -> dict | None:
    versions = sorted(set.intersection(*(set(r.evals) for r in runs)))
    if not versions:
        return None
    ys = np.array([[r.evals[v] for v in versions] for r in runs])
    return {"versions": versions, **cs.band(ys)}


def time_to_target(runs: list[Run], target: float, smooth: int, settings: dict) -> dict:
    times = [cs.time_to_target(r.x["wall_time_s"], r.smoothed, target, smooth - 1) for r in runs]
    values = [np.inf if t is None else t for t in times]
    result = cs.bootstrap(values, np.median, settings["num_resamples"], settings["seed"])
    return {**result, "reached": sum(t is not None for t in times), "per_seed": times}


def at_equal_first_use(runs: list[Run], grid: np.ndarray, fraction: float) -> dict[int, dict]:
    """Per seed, on the plan's first-use grid: the final-window and whole-range mean of
    the unsmoothed reward (the window is the smoothing; a trailing mean would lag)."""
    out = {}
    for r in runs:
        y = cs.interpolate(r.x["first_use_samples"], r.reward, grid)
        out[r.seed] = {"final_reward": cs.window_mean(grid, y, fraction),
                       "auc_reward": cs.area_mean(grid, y)}
    return out


def paired(entry: dict[int, dict], reference: dict[int, dict], settings: dict) -> dict:
    seeds = sorted(set(entry) & set(reference))
    out = {}
    for metric in ("final_reward", "auc_reward", "held_out_last", "held_out_mean"):
        if seeds and all(metric in entry[s] and metric in reference[s] for s in seeds):
            out[metric] = cs.paired_bootstrap([entry[s][metric] for s in seeds],
                                              [reference[s][metric] for s in seeds],
                                              settings["num_resamples"], settings["seed"])
    return out


def analyse(plan: Plan, runs: dict[str, list[Run]], settings: dict) -> dict:
    done = {name: rs for name, rs in runs.items() if rs}
    smooth, fraction = settings["smooth_steps"], settings["final_fraction"]
    result: dict = {"entries": {}, "paired_vs_reference": {}}
    grid = cs.common_grid([r.x["first_use_samples"] for rs in done.values() for r in rs],
                          settings["grid_points"]) if done else np.empty(0)
    result["equal_first_use_range"] = [float(grid[0]), float(grid[-1])] if grid.size else None
    per_seed: dict[str, dict[int, dict]] = {}
    for name, rs in done.items():
        summary = {"num_seeds": len(rs), "seeds": [r.seed for r in rs],
                   # The whole process, start-up included: what a seed of it costs.
                   "run_elapsed_s": _spread([r.elapsed_s for r in rs if r.elapsed_s is not None]),
                   "curves": curves(rs, settings["grid_points"]),
                   "held_out": held_out(rs),
                   "time_to_target_s": time_to_target(rs, plan.target_reward, smooth, settings),
                   "final_reward_end_of_run": interval([float(r.reward[-smooth:].mean())
                                                        for r in rs]),
                   "offpolicy": {name: _spread([r.offpolicy[name] for r in rs
                                                if name in r.offpolicy])
                                 for name in (*cs.OFFPOLICY, "max_staleness")}}
        if grid.size:
            per_seed[name] = at_equal_first_use(rs, grid, fraction)
            summary["at_equal_first_use"] = {
                m: interval([v[m] for v in per_seed[name].values()])
                for m in ("final_reward", "auc_reward")}
            summary["at_equal_first_use"]["per_seed"] = per_seed[name]
        result["entries"][name] = summary
    # Held-out reward per seed, at the versions an entry and the reference share.
    ref = plan.reference
    for name in per_seed:
        if name == ref or ref not in per_seed:
            continue
        shared = sorted(set.intersection(*(set(r.evals) for r in done[name] + done[ref])))
        for label in (name, ref):
            for r in done[label]:
                if shared:
                    per_seed[label][r.seed]["held_out_last"] = r.evals[shared[-1]]
                    per_seed[label][r.seed]["held_out_mean"] = float(
                        np.mean([r.evals[v] for v in shared]))
        result["paired_vs_reference"][name] = {
            **paired(per_seed[name], per_seed[ref], settings),
            "held_out_versions": shared}
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="results directory: DIR/<entry>/seed<k>/")
    parser.add_argument("--plan", help="a YAML plan (config, overrides, seeds, reference, "
                        "target_reward, entries)")
    parser.add_argument("--config", help="the entries' job spec (default: the plan's, else "
                        "examples/bench_modes.yaml)")
    parser.add_argument("--entry", action="append", default=[], metavar="NAME:OVERRIDES",
                        help="an entry, e.g. sync:mode=sync or trl: (repeatable)")
    parser.add_argument("--seeds", help="e.g. 0-7 or 0,2,5 (default: the plan's, else 0)")
    parser.add_argument("--reference", help="the entry differences are taken to (default sync)")
    parser.add_argument("--target-reward", type=float)
    parser.add_argument("--smooth-steps", type=int, default=5,
                        help="trailing mean over this many steps (default 5)")
    parser.add_argument("--final-fraction", type=float, default=0.2,
                        help="the final window: this share of the first-use range (default 0.2)")
    parser.add_argument("--grid-points", type=int, default=101)
    parser.add_argument("--bootstrap", type=int, default=10_000, help="bootstrap resamples")
    parser.add_argument("--bootstrap-seed", type=int, default=0)
    parser.add_argument("--analyse-only", action="store_true",
                        help="read the runs in --out; run nothing")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value",
                        help="applied to every entry, before the entry's own")
    args = parser.parse_args(argv)
    if args.smooth_steps < 1 or not 0 < args.final_fraction <= 1:
        raise SystemExit("--smooth-steps must be at least 1, --final-fraction in (0, 1]")
    out = Path(args.out).absolute()
    plan = build_plan(args, out)
    steps = expected_steps(plan)
    out.mkdir(parents=True, exist_ok=True)
    if not args.analyse_only:
        (out / "plan.json").write_text(json.dumps(asdict(plan), indent=2))
        run_plan(plan, steps, out)
    settings = {"smooth_steps": args.smooth_steps, "final_fraction": args.final_fraction,
                "grid_points": args.grid_points, "num_resamples": args.bootstrap,
                "seed": args.bootstrap_seed}
    runs, missing = load_runs(plan, steps, out, args.smooth_steps)
    result = {"plan": asdict(plan), "settings": settings, "missing_runs": missing,
              **analyse(plan, runs, settings)}
    (out / "convergence.json").write_text(json.dumps(json_safe(result), indent=2))
    print_table(plan, result, missing)
    if result["entries"]:
        plot(plan, result, out / "convergence.png")
    print(f"\nresults: {out / 'convergence.json'}, {out / 'convergence.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
