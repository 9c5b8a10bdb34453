"""Held-out validation of `reflow sim`: the cost model calibrated on one workload's
runs predicts another workload's ratios to sync.

    python bench/sim_heldout.py --validation bench/sim/validation_cpu.json \\
        --out bench/out/sim_heldout   # writes OUT/validation_heldout.json

(bench/sim/validation_heldout_cpu.json is that run's; docs/guide/simulator.md shows it.)

bench/sim_validate.py calibrates on a workload's runs and predicts the same
runs (in-sample). Here, for each calibration workload C and predicted workload
P, the costs are assembled (`held_out_costs`) from:
- C, what belongs to the machine and the engine: the engine's decode step in
  the job (its floor and per-sequence term, its KV capacity and batch limit),
  the trainer's FLOPS a core and its fixed cost a step, the weight sync;
- P, what describes P itself: its prompt and response-length distribution (the
  length model), its job (batch, group size, steps, max_tokens) and its model's
  parameter count.
When P's model is not C's (rollout_bound and balanced run tiny-qwen3, math
SmolLM2-135M), the decode step is P's model's engine benchmarked alone on this
machine (`engines` of the validation JSON, the curve `decode_cost` fits), times
C's in-job slowdown of the engine (how much sharing the cores with the trainer,
the rollout front end and Redis slows a decode step: a property of the machine
and the job's layout). `reflow sim plan`'s scaling (sim/plan.py:scaled_costs)
is not used for the decode step: it scales the floor with the weights' bytes
and leaves the per-sequence term, right for a bandwidth-bound GPU engine, but
a CPU engine on a small model spends its step in per-step overhead, so the
floor grows far less than the parameters (OUT's `model_scaling` gives both
floors). The trainer has no benchmark of its own, so it is scaled as `reflow
sim plan` scales it: P's parameters at C's FLOPS a core and C's fixed cost a
step.

The weight sync is a mode's measured seconds a step (sim_validate.py's
`sync_cost`); a validation JSON written before it recorded them (`sync` per
workload) lacks them, and the raw runs are not always at hand. Then each
workload's sync seconds per mode are recovered from the JSON itself: the
overhead at which the workload's own costs reproduce its in-sample simulated
tokens/s (bisection on the seeds' median), written to OUT's `sync_s` with the
throughput reproduced. `python bench/sim_validate.py --runs ...` (its
docstring) records them directly.

A mode P ran that C did not (C=math has no one_step_off) takes the median of
C's disaggregated modes' sync. Prints, per calibration and predicted
workload, each mode's measured and predicted ratio to sync and the error, the
in-sample pairs (C = P) beside the held-out ones.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sim_validate  # noqa: E402  (the script beside this one)

GOAL = sim_validate.GOAL
PLACEMENT_OF = {"sync": "colocated", "one_step_off": "split", "fully_async": "split",
                "reflow": "split"}
ENGINE_OF = {"colocated": "both", "split": "one"}  # the engine benchmark's cores
SYNC_BISECTIONS = 10


def _sync_cost(overhead_s: float) -> dict:
    # As sim/calibrate.py:sync_cost: the measured seconds as a fixed cost.
    return {"weight_bytes": 1.0, "bandwidth_bytes_per_s": 1e12, "overhead_s": overhead_s,
            "colocate_switch_s": 0.0}


def engine_decode(engines: dict, model: str, placement: str) -> dict:
    """The DecodeCost (a mapping) through `model`'s engine benchmarked alone on the
    placement's cores."""
    from reflow.sim import calibrate

    if model not in engines:
        raise ValueError(f"engines: no benchmark of {model!r} (have {sorted(engines)})")
    bench = engines[model][ENGINE_OF[placement]]
    steps = {int(n): float(ms) for n, ms in bench["step_ms"].items()}
    return calibrate.decode_cost(steps, bench["kv_cache_tokens"],
                                 bench["max_num_seqs"]).model_dump()


def held_out_costs(calibration: dict, predicted: dict, engines: dict) -> dict[str, dict]:
    """Per placement, the cost model (a CostModel mapping less `sync`) that predicts
    the `predicted` workload from the `calibration` one (entries of a validation
    JSON's `workloads`): the machine's and the engine's costs from the
    calibration workload, the workload's own lengths and parameters from the
    predicted one; the decode step from the predicted model's engine benchmark
    when the models differ (the module docstring says why)."""
    same_model = calibration["model"] == predicted["model"]
    costs = {}
    for placement, own in predicted["costs"].items():
        theirs = calibration["costs"][placement]
        if same_model:
            decode = dict(theirs["decode"])
        else:
            decode = engine_decode(engines, predicted["model"], placement)
            slowdown = calibration["engine_in_job_slowdown"][placement]
            decode["floor_ms"] *= slowdown
            decode["per_sequence_ms"] *= slowdown
        train = {**theirs["train"], "parameters": own["train"]["parameters"]}
        costs[placement] = {"decode": decode, "lengths": dict(own["lengths"]), "train": train,
                            "gpus_per_engine": own["gpus_per_engine"]}
    return costs


def sync_for(calibration_sync: dict[str, float], modes: list[str]) -> dict[str, dict]:
    """Each predicted mode's SyncCost mapping from the calibration workload's sync
    seconds by mode; a mode it did not run takes its disaggregated modes' median."""
    split = [s for m, s in calibration_sync.items() if m != "sync"]
    out = {}
    for mode in modes:
        if mode in calibration_sync:
            out[mode] = _sync_cost(calibration_sync[mode])
        elif mode != "sync" and split:
            out[mode] = _sync_cost(statistics.median(split))
        else:
            raise ValueError(f"no weight sync for {mode}: the calibration workload ran "
                             f"{sorted(calibration_sync)}")
    return out


def _median_tps(summaries: list[dict]) -> float:
    return statistics.median(s["throughput_tokens_per_s"] for s in summaries)


def recover_sync(workload: str, entry: dict, seeds: list[int], out: Path,
                 client) -> dict[str, dict]:
    """Per mode, the weight sync seconds at which the workload's own costs give its
    in-sample simulated tokens/s (the seeds' median), by bisection: more sync,
    fewer tokens/s. 0 where even no sync is slower than the in-sample run."""
    job = sim_validate.bench_job(workload)
    found = {}
    for mode, row in entry["modes"].items():
        costs = entry["costs"][PLACEMENT_OF[mode]]
        target = row["simulated_tokens_per_s"]["median"]

        def tps(overhead_s: float) -> float:
            return _median_tps(sim_validate.simulate(
                job, costs, [mode], {mode: _sync_cost(overhead_s)}, seeds,
                out / "sync" / workload / mode, client)[mode])

        low, high = 0.0, 1.0
        at_low = tps(low)
        if at_low > target:
            while tps(high) > target and high < 1e3:
                low, high = high, high * 4
            for _ in range(SYNC_BISECTIONS):
                mid = (low + high) / 2
                low, high = (mid, high) if tps(mid) > target else (low, mid)
        found[mode] = {"overhead_s": (low + high) / 2 if at_low > target else 0.0,
                       "in_sample_tokens_per_s": target}
        found[mode]["reproduced_tokens_per_s"] = tps(found[mode]["overhead_s"])
    return found


def predict(calibration: str, predicted: str, report: dict, sync_s: dict[str, dict],
            seeds: list[int], out: Path, client) -> dict:
    """One (calibration, predicted) pair: each of the predicted workload's modes'
    measured and predicted ratio to sync."""
    cal, pred = report["workloads"][calibration], report["workloads"][predicted]
    costs = held_out_costs(cal, pred, report["engines"])
    modes = list(pred["modes"])
    sync = sync_for({m: s["overhead_s"] for m, s in sync_s[calibration].items()}, modes)
    job = sim_validate.bench_job(predicted)
    where = out / "runs" / calibration / predicted
    sim = sim_validate.simulate(job, costs["colocated"], ["sync"], sync, seeds,
                                where / "colocated", client)
    sim.update(sim_validate.simulate(job, costs["split"], [m for m in modes if m != "sync"],
                                     sync, seeds, where / "split", client))
    rows = {}
    for mode in modes:
        ratios = [s["throughput_tokens_per_s"] / b["throughput_tokens_per_s"]
                  for s, b in zip(sim[mode], sim["sync"])]
        measured = pred["modes"][mode]["measured_vs_sync"]["median"]
        predicted_ratio = statistics.median(ratios)
        rows[mode] = {"measured_vs_sync": measured, "predicted_vs_sync": predicted_ratio,
                      "predicted_min": min(ratios), "predicted_max": max(ratios),
                      "error": predicted_ratio / measured - 1,
                      "in_sample_error": pred["modes"][mode]["error"]}
    scaled = cal["model"] != pred["model"]
    return {"held_out": calibration != predicted, "model_scaled": scaled,
            "decode_from": "engine_benchmark" if scaled else "calibration", "modes": rows}


def summary(pairs: dict) -> dict:
    """Over the ratios other than sync's (1 by definition): how many, how many
    within GOAL, the median and largest error; in-sample (C = P), held-out, and
    held-out split by whether the predicted model is the calibration's."""
    kinds = {"in_sample": lambda p: not p["held_out"],
             "held_out": lambda p: p["held_out"],
             "held_out_same_model": lambda p: p["held_out"] and not p["model_scaled"],
             "held_out_other_model": lambda p: p["held_out"] and p["model_scaled"]}
    out = {}
    for kind, chosen in kinds.items():
        errors = [r["error"] for c in pairs.values() for p in c.values() if chosen(p)
                  for m, r in p["modes"].items() if m != "sync"]
        if errors:
            out[kind] = {"ratios": len(errors),
                         "within_goal": sum(abs(e) <= GOAL for e in errors),
                         "max_abs_error": max(map(abs, errors)),
                         "median_abs_error": statistics.median(map(abs, errors))}
    return out


def model_scaling(report: dict, calibration: str, predicted: str) -> dict:
    """The predicted workload's in-job decode floor (split placement) three ways:
    as calibrated on its own runs, from its model's engine benchmark (this
    script's), and as `reflow sim plan` scales the calibration model's floor by
    parameters."""
    cal, pred = report["workloads"][calibration], report["workloads"][predicted]
    k = pred["costs"]["split"]["train"]["parameters"] / cal["costs"]["split"]["train"]["parameters"]
    bench = engine_decode(report["engines"], pred["model"], "split")["floor_ms"]
    return {"parameters_ratio": k,
            "calibrated_floor_ms": pred["costs"]["split"]["decode"]["floor_ms"],
            "engine_benchmark_floor_ms": bench * cal["engine_in_job_slowdown"]["split"],
            "plan_scaled_floor_ms": cal["costs"]["split"]["decode"]["floor_ms"] * k}


def run(report: dict, seeds: list[int], out: Path, client) -> dict:
    """Every (calibration, predicted) pair of the report's workloads, on one Redis."""
    workloads = list(report["workloads"])
    sync_s = {}
    for w in workloads:
        if "sync" in report["workloads"][w]:  # recorded by sim_validate.py
            sync_s[w] = {m: {"overhead_s": s["overhead_s"]}
                         for m, s in report["workloads"][w]["sync"].items()}
        else:
            sync_s[w] = recover_sync(w, report["workloads"][w], seeds, out, client)
    pairs = {c: {p: predict(c, p, report, sync_s, seeds, out, client) for p in workloads}
             for c in workloads}
    models = {w: report["workloads"][w]["model"] for w in workloads}
    scaling = {c: {p: model_scaling(report, c, p) for p in workloads if models[p] != models[c]}
               for c in workloads}
    return {"goal": GOAL, "seeds": seeds, "sync_s": sync_s, "calibrated_on": pairs,
            "summary": summary(pairs), "model_scaling": {c: s for c, s in scaling.items() if s}}


def print_table(result: dict) -> None:
    print(f"{'calibrated on':<14} {'predicted':<22} {'mode':<13} {'measured':>9} "
          f"{'predicted':>10} {'error':>7} {'in-sample':>10}")
    for c, preds in result["calibrated_on"].items():
        for p, pair in preds.items():
            for mode, r in pair["modes"].items():
                if mode == "sync":
                    continue
                mark = "" if abs(r["error"]) <= GOAL else "  miss"
                tag = p + (" (scaled)" if pair["model_scaled"] else "")
                print(f"{c:<14} {tag:<22} {mode:<13} {r['measured_vs_sync']:>9.2f} "
                      f"{r['predicted_vs_sync']:>10.2f} {r['error']:>+7.0%} "
                      f"{r['in_sample_error']:>+10.0%}{mark}")
    for kind, s in result["summary"].items():
        print(f"{kind}: {s['within_goal']} of {s['ratios']} ratios within {GOAL:.0%}, "
              f"median |error| {s['median_abs_error']:.0%}, largest {s['max_abs_error']:.0%}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--validation", default="bench/sim/validation_cpu.json",
                    help="sim_validate.py's validation.json")
    ap.add_argument("--out", default=None, help="where to write validation_heldout.json and "
                    "the simulated runs (a temporary directory's runs when left out)")
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    import redis

    from reflow.replay.embedded import EmbeddedRedis

    report = json.loads(Path(args.validation).read_text())
    seeds = [int(s) for s in args.seeds.split(",") if s]
    with tempfile.TemporaryDirectory(prefix="reflow-heldout-") as scratch:
        out = Path(args.out) if args.out else Path(scratch)
        server = EmbeddedRedis(Path(scratch) / "redis", appendonly=False).start()
        try:
            client = redis.Redis.from_url(server.url)
            result = {"source": args.validation, **run(report, seeds, out, client)}
            client.close()
        finally:
            server.stop()
        if args.out:
            out.mkdir(parents=True, exist_ok=True)
            (out / "validation_heldout.json").write_text(json.dumps(result, indent=2) + "\n")
    print_table(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
