"""Held-out validation of the simulator (bench/sim_heldout.py): which costs a
prediction takes from the calibration workload and which from the predicted
one, the weight sync recovered from an in-sample result, and the committed
result's shape against the in-sample validation it was computed from."""

import importlib.util
import json
import math
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
VALIDATION = REPO / "bench" / "sim" / "validation_cpu.json"
HELDOUT = REPO / "bench" / "sim" / "validation_heldout_cpu.json"


@pytest.fixture(scope="module")
def heldout():
    sys.path.insert(0, str(REPO / "bench"))
    spec = importlib.util.spec_from_file_location("sim_heldout", REPO / "bench" / "sim_heldout.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _placement(floor_ms, per_seq_ms, flops, overhead_s, parameters, quantiles, gpus):
    return {"decode": {"floor_ms": floor_ms, "per_sequence_ms": per_seq_ms,
                       "per_context_token_us": 0.0, "prefill_per_token_us": 0.0,
                       "kv_capacity_tokens": 1000, "max_running_sequences": 64},
            "lengths": {"prompt_tokens": 5, "median_tokens": quantiles[1][1],
                        "max_tokens": 256, "quantiles": quantiles},
            "train": {"parameters": parameters, "flops_per_token_per_parameter": 8.0,
                      "peak_flops_per_gpu": flops, "utilisation": 1.0,
                      "step_overhead_s": overhead_s},
            "gpus_per_engine": gpus}


def _workload(model, scale, parameters, quantiles):
    return {"model": model,
            "costs": {"colocated": _placement(4 * scale, 0.2 * scale, 1e11 * scale, 0.1 * scale,
                                              parameters, quantiles, 2),
                      "split": _placement(3 * scale, 0.1 * scale, 4e10 * scale, 0.2 * scale,
                                          parameters, quantiles, 1)},
            "engine_in_job_slowdown": {"colocated": 1.5, "split": 2.0}}


ENGINES = {"big": {"one": {"step_ms": {"1": 11.0, "4": 14.0, "16": 26.0},
                           "kv_cache_tokens": 500, "max_num_seqs": 32},
                   "both": {"step_ms": {"1": 9.0, "4": 9.0, "16": 9.0},
                            "kv_cache_tokens": 500, "max_num_seqs": 32}}}


def test_the_machine_s_costs_come_from_calibration_and_the_workload_s_own_stay(heldout):
    calibration = _workload("tiny", 1.0, 4e5, [[0.1, 7.0], [0.5, 41.0], [0.9, 130.0]])
    predicted = _workload("tiny", 3.0, 4e5, [[0.1, 4.0], [0.5, 17.0], [0.9, 52.0]])
    costs = heldout.held_out_costs(calibration, predicted, ENGINES)
    for placement in ("colocated", "split"):
        theirs, own = calibration["costs"][placement], predicted["costs"][placement]
        got = costs[placement]
        assert got["decode"] == theirs["decode"]
        assert got["train"] == theirs["train"]
        assert got["lengths"] == own["lengths"]
        assert got["gpus_per_engine"] == own["gpus_per_engine"]
    # The result validates as the simulator's cost model.
    from reflow.sim.costs import CostModel
    CostModel.model_validate(costs["split"])


def test_another_model_decodes_at_its_engine_benchmark_times_the_calibration_slowdown(heldout):
    calibration = _workload("tiny", 1.0, 4e5, [[0.1, 7.0], [0.5, 41.0], [0.9, 130.0]])
    predicted = _workload("big", 20.0, 1.3e8, [[0.1, 9.0], [0.5, 20.0], [0.9, 64.0]])
    costs = heldout.held_out_costs(calibration, predicted, ENGINES)
    # One core's benchmark is 10 ms + 1 ms a sequence exactly; split's slowdown is 2.
    split = costs["split"]["decode"]
    assert math.isclose(split["floor_ms"], 20.0) and math.isclose(split["per_sequence_ms"], 2.0)
    assert (split["kv_capacity_tokens"], split["max_running_sequences"]) == (500, 32)
    # Two cores: a flat curve, all floor, at colocated's slowdown of 1.5.
    colocated = costs["colocated"]["decode"]
    assert math.isclose(colocated["floor_ms"], 13.5) and colocated["per_sequence_ms"] == 0.0
    # The trainer: the predicted model's parameters at the calibration's FLOPS and overhead.
    train = costs["split"]["train"]
    assert train["parameters"] == 1.3e8
    assert train["peak_flops_per_gpu"] == calibration["costs"]["split"]["train"]["peak_flops_per_gpu"]
    assert train["step_overhead_s"] == calibration["costs"]["split"]["train"]["step_overhead_s"]
    assert costs["split"]["lengths"] == predicted["costs"]["split"]["lengths"]
    with pytest.raises(ValueError, match="no benchmark of 'big'"):
        heldout.held_out_costs(calibration, predicted, {})


def test_a_mode_the_calibration_did_not_run_takes_its_disaggregated_modes_median_sync(heldout):
    sync = heldout.sync_for({"sync": 0.0, "fully_async": 0.2, "reflow": 0.4},
                            ["sync", "one_step_off", "reflow"])
    assert [sync[m]["overhead_s"] for m in ("sync", "one_step_off", "reflow")] \
        == pytest.approx([0.0, 0.3, 0.4])
    assert all(s["colocate_switch_s"] == 0.0 for s in sync.values())
    with pytest.raises(ValueError, match="no weight sync for sync"):
        heldout.sync_for({"reflow": 0.4}, ["sync"])


def test_the_weight_sync_is_recovered_from_the_in_sample_throughput(heldout, monkeypatch):
    # A simulated step of 2 s plus the sync: 1000 tokens a step.
    def fake_simulate(job, costs, modes, sync, seeds, out, client=None):
        return {m: [{"throughput_tokens_per_s": 1000 / (2.0 + sync[m]["overhead_s"])}
                    for _ in seeds] for m in modes}

    monkeypatch.setattr(heldout.sim_validate, "simulate", fake_simulate)
    monkeypatch.setattr(heldout.sim_validate, "bench_job", lambda w: {})
    entry = {"costs": {"colocated": {}, "split": {}},
             "modes": {"sync": {"simulated_tokens_per_s": {"median": 1000 / 2.3}},
                       "reflow": {"simulated_tokens_per_s": {"median": 1000 / 7.0}},
                       "fully_async": {"simulated_tokens_per_s": {"median": 600.0}}}}
    found = heldout.recover_sync("w", entry, [0], Path("unused"), None)
    assert found["sync"]["overhead_s"] == pytest.approx(0.3, abs=2e-3)
    assert found["reflow"]["overhead_s"] == pytest.approx(5.0, abs=1e-2)
    # Faster than the simulation can be with no sync at all: no sync.
    assert found["fully_async"]["overhead_s"] == 0.0
    assert found["fully_async"]["reproduced_tokens_per_s"] == 500.0


def test_the_summary_counts_non_sync_ratios_within_the_goal(heldout):
    def pair(held, scaled, errors):
        return {"held_out": held, "model_scaled": scaled,
                "modes": {"sync": {"error": 0.0},
                          **{f"m{i}": {"error": e} for i, e in enumerate(errors)}}}

    pairs = {"a": {"a": pair(False, False, [0.1]), "b": pair(True, False, [0.3, -0.1])},
             "b": {"a": pair(True, False, [-0.25]), "b": pair(False, False, [0.05])}}
    s = heldout.summary(pairs)
    assert s["in_sample"] == {"ratios": 2, "within_goal": 2, "max_abs_error": 0.1,
                              "median_abs_error": pytest.approx(0.075)}
    assert (s["held_out"]["ratios"], s["held_out"]["within_goal"]) == (3, 1)
    assert s["held_out"]["max_abs_error"] == 0.3
    assert s["held_out_same_model"] == s["held_out"]
    assert "held_out_other_model" not in s  # no pair of two models
    pairs["b"]["a"]["model_scaled"] = True
    s = heldout.summary(pairs)
    assert (s["held_out_same_model"]["ratios"], s["held_out_other_model"]["ratios"]) == (2, 1)


def test_the_committed_result_covers_every_pair_of_the_in_sample_validation():
    validation = json.loads(VALIDATION.read_text())
    result = json.loads(HELDOUT.read_text())
    workloads = validation["workloads"]
    assert set(result["calibrated_on"]) == set(workloads)
    errors = {True: [], False: []}
    for c, predictions in result["calibrated_on"].items():
        assert set(predictions) == set(workloads)
        for p, pair in predictions.items():
            assert pair["held_out"] == (c != p)
            assert pair["model_scaled"] == (workloads[c]["model"] != workloads[p]["model"])
            assert set(pair["modes"]) == set(workloads[p]["modes"])
            for mode, row in pair["modes"].items():
                measured = workloads[p]["modes"][mode]
                assert row["measured_vs_sync"] == measured["measured_vs_sync"]["median"]
                assert row["in_sample_error"] == measured["error"]
                assert row["error"] == pytest.approx(
                    row["predicted_vs_sync"] / row["measured_vs_sync"] - 1)
                assert row["predicted_min"] <= row["predicted_vs_sync"] <= row["predicted_max"]
                if mode == "sync":
                    assert row["predicted_vs_sync"] == 1.0
                else:
                    errors[pair["held_out"]].append(row["error"])
    for kind, held in (("held_out", True), ("in_sample", False)):
        s = result["summary"][kind]
        assert s["ratios"] == len(errors[held])
        assert s["within_goal"] == sum(abs(e) <= result["goal"] for e in errors[held])
        assert s["max_abs_error"] == max(map(abs, errors[held]))
    split = [result["summary"][k] for k in ("held_out_same_model", "held_out_other_model")]
    assert sum(s["ratios"] for s in split) == result["summary"]["held_out"]["ratios"]
    # The in-sample pairs (C = P) run the same assembly: they reproduce sim_validate.py's.
    for w in workloads:
        for mode, row in result["calibrated_on"][w][w]["modes"].items():
            assert row["error"] == pytest.approx(row["in_sample_error"], abs=0.01)
    assert set(result["sync_s"]) == set(workloads)
    for w, modes in result["sync_s"].items():
        assert set(modes) == set(workloads[w]["modes"])
        assert all(m["overhead_s"] >= 0 for m in modes.values())


def test_without_the_elastic_pool_every_engine_generates(tmp_path):
    # The validation's jobs have no elastic pool (scheduler.placement off, or a
    # baseline mode): no engine may wait in the trainer's role, or a one-engine
    # job never trains.
    import redis

    from reflow.replay.embedded import EmbeddedRedis
    from reflow.sim.command import load_config
    from reflow.sim.run import Simulation

    config = load_config(REPO / "examples" / "sim" / "qwen3_8b.yaml",
                         ["scheduler.placement=false", "steps=3", "warmup_steps=1",
                          "samples_per_gpu=8", "rollout_fraction=0.5",
                          "costs.lengths.median_tokens=300"])
    server = EmbeddedRedis(tmp_path / "redis", appendonly=False).start()
    try:
        client = redis.Redis.from_url(server.url)
        for mode in ("fully_async", "reflow"):
            sim = Simulation(config, mode, 4, client, tmp_path / mode, report=False)
            assert sim.run()["steps"] == 3
            assert sorted(sim.engines) == ["rollout-0", "rollout-1"]
            assert all(e.generated_tokens > 0 for e in sim.engines.values()), mode
        client.close()
    finally:
        server.stop()
