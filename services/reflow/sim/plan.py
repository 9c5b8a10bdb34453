"""`reflow sim plan --model-size 8B --gpus 64 --workload FILE`: size a cluster
before renting it. Each candidate is one reflow-mode simulation (sim/run.py) of
the workload at the model size; the search is coordinate-wise, not exhaustive:
the initial rollout:trainer split first, then σ (replay.replay_cap), δ
(replay.max_staleness), the sync interval and B_max (rollout.
max_samples_per_step), each at the best found so far. Prints the best few by
predicted throughput with their idle ratios and staleness, and writes every
candidate to OUT/plan.json.

The model size scales the workload's cost model (sim/costs.py) from the
parameters it states: training FLOPs, the weights' bytes (sync, the decode
floor), the KV bytes a token (taken as proportional to the parameters, an
assumption: layer count and KV heads grow with size), prefill FLOPs and the
KV capacity left beside the weights. A model whose weights do not fit beside a
useful KV cache on one GPU gets tensor-parallel engines (powers of two). The
decoder's shape (costs.model), which sizes a LoRA job's adapters, is widened by
the square root of the parameter ratio at the same depth (an assumption).
"""

from __future__ import annotations

import argparse
import json
import math
import re
import tempfile
from pathlib import Path

from reflow.core.config import apply_overrides
from reflow.sim.command import load_config
from reflow.sim.costs import CostModel, SimConfig

# An engine GPU's memory for vLLM: 80 GB (H100 SXM) x gpu_memory_utilization 0.9.
ENGINE_MEMORY_BYTES = 72e9
# Weights may take at most this share of an engine's memory; the rest is KV cache.
MAX_WEIGHT_SHARE = 0.5
SPLITS = (0.5, 0.625, 0.75, 0.875)
REPLAY_CAPS = (0.0, 0.25, 0.5)
STALENESS = (1, 2)
SYNC_INTERVALS = (1, 2)
B_MAX_FACTORS = (1, 2)
_SIZE = re.compile(r"(\d+(?:\.\d+)?)\s*([bBmM])")


def parse_size(text: str) -> float:
    """'8B' -> 8e9, '135M' -> 1.35e8."""
    match = _SIZE.fullmatch(text.strip())
    if match is None:
        raise ValueError(f"--model-size: {text[:40]!r} is not a size like 8B or 135M")
    value = float(match.group(1)) * (1e9 if match.group(2) in "bB" else 1e6)
    if not 1e7 <= value <= 2e12:
        raise ValueError(f"--model-size: {text[:40]!r} is outside 10M to 2T parameters")
    return value


def scaled_costs(costs: CostModel, parameters: float) -> CostModel:
    """The cost model of a model of `parameters` from the one the workload states."""
    k = parameters / costs.train.parameters
    weights = costs.sync.weight_bytes * k
    # KV bytes a token, from the stated capacity beside the stated weights.
    kv_per_token = (ENGINE_MEMORY_BYTES * costs.gpus_per_engine - costs.sync.weight_bytes) \
        / costs.decode.kv_capacity_tokens * k
    tp = 1
    while weights / tp > MAX_WEIGHT_SHARE * ENGINE_MEMORY_BYTES:
        tp *= 2
    d = costs.decode
    per_gpu = k * costs.gpus_per_engine / tp  # the weights and KV each GPU reads a step
    decode = d.model_copy(update={
        "floor_ms": d.floor_ms * per_gpu,
        "per_context_token_us": d.per_context_token_us * per_gpu,
        "prefill_per_token_us": d.prefill_per_token_us * per_gpu,
        "kv_capacity_tokens": max(1, int((ENGINE_MEMORY_BYTES * tp - weights) / kv_per_token))})
    return costs.model_copy(update={
        "decode": decode, "gpus_per_engine": tp,
        "train": costs.train.model_copy(update={"parameters": parameters}),
        "model": costs.model.widened(math.sqrt(k)),
        "sync": costs.sync.model_copy(update={"weight_bytes": weights})})


def _candidate(config: SimConfig, gpus: int, knobs: dict) -> SimConfig:
    from reflow.sim.run import job_spec

    job = apply_overrides(json.loads(json.dumps(config.job)), [
        f"replay.replay_cap={knobs['replay_cap']}",
        f"replay.max_staleness={knobs['max_staleness']}",
        f"trainer.sync_interval={knobs['sync_interval']}"])
    candidate = config.model_copy(update={"job": job,
                                          "rollout_fraction": knobs["rollout_fraction"]})
    if knobs["b_max_factor"] != 1:
        batch = job_spec(candidate, "reflow", gpus).trainer.batch_size
        job.setdefault("rollout", {})["max_samples_per_step"] = batch * knobs["b_max_factor"]
        candidate = candidate.model_copy(update={"job": job})
    return candidate


def evaluate(config: SimConfig, gpus: int, knobs: dict, client, out: Path) -> dict:
    """One candidate's reflow-mode simulation, summarised."""
    from reflow.sim.run import Simulation

    name = "-".join(f"{k}={v}" for k, v in knobs.items())
    summary = Simulation(_candidate(config, gpus, knobs), "reflow", gpus, client,
                         out / name, report=False).run()
    rollout_gpus = summary["rollout_engines"] * config.costs.gpus_per_engine
    return {**knobs, "split": f"{rollout_gpus}:{gpus - rollout_gpus}",
            **{k: summary[k] for k in (
                "throughput_tokens_per_s", "trainer_idle_ratio", "rollout_idle_ratio",
                "mean_staleness", "replay_fraction", "role_flips", "rollout_engines_mean",
                "simulated_s", "wall_s")}}


def search(config: SimConfig, gpus: int, client, out: Path) -> list[dict]:
    """Coordinate search from the workload's own settings."""
    job = config.job
    best = {"rollout_fraction": config.rollout_fraction,
            "replay_cap": job.get("replay", {}).get("replay_cap", 0.5),
            "max_staleness": job.get("replay", {}).get("max_staleness", 1),
            "sync_interval": job.get("trainer", {}).get("sync_interval", 1),
            "b_max_factor": 1}
    seen: dict[tuple, dict] = {}

    def run(knobs: dict) -> dict | None:
        """The candidate's row; None for a split the GPU count cannot make. Two
        fractions that round to one split are one candidate."""
        from reflow.sim.run import job_spec, split

        candidate = _candidate(config, gpus, knobs)
        try:
            engines, _ = split(candidate, job_spec(candidate, "reflow", gpus), gpus)
        except ValueError:
            return None
        key = (engines, *sorted((k, v) for k, v in knobs.items() if k != "rollout_fraction"))
        if key not in seen:
            seen[key] = evaluate(config, gpus, knobs, client, out)
        return seen[key]

    for name, values in (("rollout_fraction", SPLITS), ("replay_cap", REPLAY_CAPS),
                         ("max_staleness", STALENESS), ("sync_interval", SYNC_INTERVALS),
                         ("b_max_factor", B_MAX_FACTORS)):
        results = [r for r in (run({**best, name: v}) for v in values) if r is not None]
        if results:
            top = max(results, key=lambda r: r["throughput_tokens_per_s"])
            best = {k: top[k] for k in best}
    return sorted(seen.values(), key=lambda r: -r["throughput_tokens_per_s"])


def table(rows: list[dict]) -> str:
    lines = [f"{'rollout:trainer':>15} {'σ':>5} {'δ':>3} {'sync':>5} {'B_max':>6} "
             f"{'tokens/s':>10} {'trainer idle':>13} {'rollout idle':>13} {'staleness':>10} "
             f"{'replay':>7} {'flips':>6}"]
    for r in rows:
        lines.append(f"{r['split']:>15} {r['replay_cap']:>5} {r['max_staleness']:>3} "
                     f"{r['sync_interval']:>5} {str(r['b_max_factor']) + 'b':>6} "
                     f"{r['throughput_tokens_per_s']:>10.0f} {r['trainer_idle_ratio']:>13.3f} "
                     f"{r['rollout_idle_ratio']:>13.3f} {r['mean_staleness']:>10.2f} "
                     f"{r['replay_fraction']:>7.2f} {r['role_flips']:>6}")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="reflow sim plan", description="Search initial rollout:trainer splits, σ, δ, the "
        "sync interval and B_max on the simulator for a model size and GPU count.")
    parser.add_argument("--model-size", required=True, help="parameters: 8B, 32B, 135M")
    parser.add_argument("--gpus", type=int, required=True, help="GPUs in the cluster")
    parser.add_argument("--workload", required=True,
                        help="a sim config: the job, its response lengths, the cost model "
                        "(examples/sim/qwen3_8b.yaml)")
    parser.add_argument("--steps", type=int, default=30, help="steps per candidate (30)")
    parser.add_argument("--top", type=int, default=5, help="candidates to print (5)")
    parser.add_argument("--out", default=None, help="where to write plan.json and each run")
    args = parser.parse_args(argv)
    try:
        parameters = parse_size(args.model_size)
        if not 2 <= args.gpus <= 100_000:
            raise ValueError(f"--gpus: {args.gpus} is not in [2, 100000]")
        if not 2 <= args.steps <= 100_000:
            raise ValueError(f"--steps: {args.steps} is not in [2, 100000]")
        config = load_config(Path(args.workload))
        config = config.model_copy(update={
            "steps": args.steps, "warmup_steps": min(config.warmup_steps, args.steps // 4),
            "costs": scaled_costs(config.costs, parameters)})
    except (OSError, ValueError) as err:
        parser.error(str(err))
    import redis

    from reflow.replay.embedded import EmbeddedRedis

    with tempfile.TemporaryDirectory(prefix="reflow-plan-") as scratch:
        out = Path(args.out) if args.out else Path(scratch) / "runs"
        server = EmbeddedRedis(Path(scratch) / "redis", appendonly=False).start()
        try:
            client = redis.Redis.from_url(server.url)
            rows = search(config, args.gpus, client, out)
            client.close()
        finally:
            server.stop()
        if args.out:
            (out / "plan.json").write_text(json.dumps(
                {"model_size": args.model_size, "parameters": parameters, "gpus": args.gpus,
                 "gpus_per_engine": config.costs.gpus_per_engine, "steps": args.steps,
                 "candidates": rows}, indent=2) + "\n")
    print(f"{args.model_size} ({parameters:.3g} parameters) on {args.gpus} GPUs, "
          f"{config.costs.gpus_per_engine} GPU(s) an engine, {len(rows)} candidates of "
          f"{args.steps} steps; predicted, best {min(args.top, len(rows))}:")
    print(table(rows[:args.top]))
    return 0
