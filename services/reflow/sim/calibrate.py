"""The simulator's cost model fitted to this machine's own measurements, for the
validation of `reflow sim` against real runs (bench/sim_validate.py).

Each fit takes what a real run measures and returns a cost section of
sim/costs.py:
- `decode_cost`: decode step times an engine measured at several batch sizes
  (least squares of step time on running sequences: the floor and the
  per-sequence term; the context term is left at 0, which a 2-layer model's
  attention makes small);
- `in_job_decode_cost`: that engine's curve scaled to the decode steps it took
  inside a job (`engine_step_ms` at `engine_step_sequences` of the step
  records): an engine alone on the cores is not the engine beside a trainer, a
  rollout front end, Redis and the scheduler;
- `train_cost`: the trainer's `train_s` against `trained_tokens` per step of a
  real run's metrics.jsonl (an intercept, the step's fixed cost, and a slope,
  seconds a token, given as FLOPS over the run's trainer cores);
- `length_model`: the response length's quantile function through the
  batches' median p10, p50, p90 and longest lengths (`response_len_*` of the
  records), capped at the job's max_tokens;
- `sync_cost`: the weight sync's measured seconds a step, as the fixed cost;
- `tool_cost`: a tool call's latency, lognormal through the sandbox benchmark's
  p50 and p99 of one program at one number of concurrent callers
  (bench/sandbox.py's JSON): `reflow sim --tool-latency-from`.
"""

from __future__ import annotations

import math
import statistics

from reflow.sim.costs import DecodeCost, LengthModel, SyncCost, ToolCost, TrainCost

def least_squares(points: list[tuple[float, float]]) -> tuple[float, float]:
    """(intercept, slope) of y on x; ValueError when x does not vary."""
    if len(points) < 2:
        raise ValueError(f"a fit needs two points or more, not {len(points)}")
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs points at more than one x")
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx
    return my - slope * mx, slope


def decode_cost(step_ms: dict[int, float], kv_capacity_tokens: int,
                max_running_sequences: int, prefill_per_token_us: float = 0.0) -> DecodeCost:
    """A DecodeCost through an engine's measured decode step (ms) by running
    sequences: floor + per_sequence x running, both non-negative."""
    floor, per_sequence = least_squares([(float(n), ms) for n, ms in step_ms.items()])
    if per_sequence < 0:  # a flat curve: all floor
        floor, per_sequence = statistics.fmean(step_ms.values()), 0.0
    return DecodeCost(floor_ms=max(floor, 1e-3), per_sequence_ms=per_sequence,
                      per_context_token_us=0.0, prefill_per_token_us=prefill_per_token_us,
                      kv_capacity_tokens=kv_capacity_tokens,
                      max_running_sequences=max_running_sequences)


def in_job_slowdown(alone: DecodeCost, records: list[dict]) -> float:
    """The median, over the steps that decoded, of the engine's mean decode step in
    the job (`engine_step_ms`) over the step the engine alone takes at the same
    mean batch (`engine_step_sequences`). The curve alone (`decode_cost`'s, no
    context term) is linear in running sequences, so its value at the mean batch
    is its mean step, exactly."""
    if alone.per_context_token_us:
        raise ValueError("in_job_slowdown takes decode_cost's curve, without a context term")
    ratios = [r["engine_step_ms"]
              / (alone.floor_ms + alone.per_sequence_ms * r["engine_step_sequences"])
              for r in records if r.get("engine_step_ms", 0) > 0
              and r.get("engine_step_sequences", 0) > 0]
    if not ratios:
        raise ValueError("no step record has engine_step_ms: the runs predate the engine's "
                         "step counters, or the engine counted no steps (REFLOW_ENGINE_STATS=0)")
    return float(statistics.median(ratios))


def in_job_decode_cost(alone: DecodeCost, records: list[dict]) -> DecodeCost:
    """`alone` with its floor and per-sequence term scaled by `in_job_slowdown`:
    the curve's shape from the engine benchmarked by itself (a job's steps span
    too narrow a range of batches to fit a slope: a sync job's are all one
    batch), its level from the steps the engine took in the job."""
    scale = in_job_slowdown(alone, records)
    return alone.model_copy(update={"floor_ms": alone.floor_ms * scale,
                                    "per_sequence_ms": alone.per_sequence_ms * scale})


def train_cost(records: list[dict], cores: int, parameters: float) -> TrainCost:
    """A TrainCost whose step_s(tokens, cores) is the least-squares line of a
    real run's `train_s` on `trained_tokens`: the intercept as the step's
    overhead, the slope as FLOPS per core (8 FLOPs a token a parameter, at full
    utilisation: the slope is measured, not derived)."""
    intercept, per_token = least_squares([(r["trained_tokens"], r["train_s"]) for r in records])
    if per_token <= 0:
        raise ValueError(f"train_s does not grow with trained tokens ({per_token:.3g} s a "
                         "token): too few or too alike steps to fit")
    flops = 8.0
    return TrainCost(parameters=parameters, flops_per_token_per_parameter=flops,
                     peak_flops_per_gpu=parameters * flops / (per_token * cores), utilisation=1.0,
                     step_overhead_s=max(0.0, intercept))


def length_model(records: list[dict], max_tokens: int, prompt_tokens: int,
                 batch_size: int) -> LengthModel:
    """The response length's quantile function through the records' median p10,
    p50, p90 and longest length, the longest at probability b / (b + 1) (the
    expected rank of the longest of b draws), each sample drawn alone: a
    policy that has not learned the task gives a group's samples a prompt in
    common, not a length. A lognormal through p50 and p90 misses the short
    end: on the rollout-bound workload it puts p10 at 13 tokens where the
    batches measured 7."""
    def median_of(field: str) -> float:
        return float(statistics.median(r[field] for r in records))

    p10, p50, p90 = (median_of(f"response_len_p{q}") for q in (10, 50, 90))
    longest = median_of("response_len_max")
    if p10 < 1:
        raise ValueError("response_len_p10 is 0: no lengths to fit")
    points = [(0.1, p10), (0.5, max(p10, p50)), (0.9, max(p10, p50, p90)),
              (batch_size / (batch_size + 1), max(p10, p50, p90, longest))]
    return LengthModel(prompt_tokens=prompt_tokens, median_tokens=p50, group_sigma=0.0,
                       sample_sigma=0.0, max_tokens=max_tokens, quantiles=points)


def sync_cost(records: list[dict]) -> SyncCost:
    """The weight sync as a fixed cost: the median of `weight_sync_s` less the
    wait for the engines to pause (the simulator adds that wait itself). Its
    bytes are ~0, so a job's `lora` does not reprice it: fit it to runs that
    synced what the simulated job syncs (adapters for a LoRA job)."""
    seconds = statistics.median(max(0.0, r["weight_sync_s"] - r.get("sync_wait_s", 0.0))
                                for r in records)
    return SyncCost(weight_bytes=1.0, bandwidth_bytes_per_s=1e12, overhead_s=seconds,
                    colocate_switch_s=0.0)


# The standard normal's 0.99 quantile: p99 = median * exp(Z99 * sigma).
Z99 = 2.3263478740408408


def tool_cost(bench: dict, base: ToolCost, program: str = "print(1)", callers: int = 1,
              path: str = "grpc") -> ToolCost:
    """`base` with its latency taken from a sandbox benchmark (bench/sandbox.py's
    JSON): the median is the row's p50 and sigma puts the p99 where the row
    measured it. The row is the program's at `callers` concurrent callers through
    `path` (grpc, else local when the run measured no gRPC). ValueError naming
    what is missing."""
    rows = bench.get("rows") if isinstance(bench, dict) else None
    if not rows:
        raise ValueError("not a sandbox benchmark's output: no `rows` (bench/sandbox.py --out)")
    paths = {r.get("path") for r in rows}
    if path not in paths:
        path = "local" if "local" in paths else path
    match = [r for r in rows if r.get("program") == program and r.get("callers") == callers
             and r.get("path") == path]
    if not match:
        have = sorted({(r.get("program"), r.get("callers")) for r in rows}, key=str)
        raise ValueError(f"the sandbox benchmark has no row for program {program!r} at "
                         f"{callers} callers ({path}); it has {have}")
    p50, p99 = match[0]["p50_ms"] / 1000.0, match[0]["p99_ms"] / 1000.0
    if not p50 > 0:
        raise ValueError(f"p50 of {program!r} at {callers} callers is {p50}: nothing to fit")
    sigma = max(0.0, math.log(max(p99, p50) / p50) / Z99)
    return base.model_copy(update={"latency_median_s": p50, "latency_sigma": sigma})
