"""The cost model fitted to measurements (reflow/sim/calibrate.py): each fit gives
back what it was fitted to, and refuses what it cannot fit."""

import math
import random
from pathlib import Path

import pytest

from reflow.sim import calibrate
from reflow.trainer.loop import TrainLoop
from reflow.trainer.records import _length_quantiles, engine_step_fields

REPO = Path(__file__).resolve().parents[2]


def test_least_squares_recovers_a_line_and_refuses_one_point():
    assert calibrate.least_squares([(1, 3.0), (2, 5.0), (4, 9.0)]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError, match="two points"):
        calibrate.least_squares([(1, 1.0)])
    with pytest.raises(ValueError, match="more than one x"):
        calibrate.least_squares([(1, 1.0), (1, 2.0)])


def test_decode_cost_goes_through_the_measured_steps():
    cost = calibrate.decode_cost({1: 5.2, 4: 5.8, 16: 8.2, 64: 17.8}, 100_000, 256)
    assert cost.floor_ms == pytest.approx(5.0, abs=0.05)
    assert cost.per_sequence_ms == pytest.approx(0.2, abs=0.005)
    assert cost.steps_time_s(16, 0, 1) == pytest.approx(8.2e-3, rel=0.02)
    # A curve that falls with the batch (noise on a flat one) is all floor.
    flat = calibrate.decode_cost({1: 6.0, 64: 5.0}, 100_000, 256)
    assert flat.per_sequence_ms == 0 and flat.floor_ms == pytest.approx(5.5)


def test_the_engine_s_curve_is_scaled_to_the_steps_it_took_in_the_job():
    alone = calibrate.decode_cost({1: 2.2, 64: 8.5}, 100_000, 256)
    # Twice as slow in the job at every batch, and one step of noise.
    records = [{"engine_step_ms": 2 * (alone.floor_ms + alone.per_sequence_ms * b),
                "engine_step_sequences": b} for b in (9.5, 17.0, 23.3, 40.0)]
    records.append({"engine_step_ms": 50.0, "engine_step_sequences": 17.0})
    assert calibrate.in_job_slowdown(alone, records) == pytest.approx(2.0)
    in_job = calibrate.in_job_decode_cost(alone, records)
    assert in_job.floor_ms == pytest.approx(2 * alone.floor_ms)
    assert in_job.per_sequence_ms == pytest.approx(2 * alone.per_sequence_ms)
    assert in_job.kv_capacity_tokens == alone.kv_capacity_tokens
    # Steps the engine did not count (or older runs) cannot be calibrated from.
    with pytest.raises(ValueError, match="engine_step_ms"):
        calibrate.in_job_slowdown(alone, [{"train_s": 1.0}, {"engine_step_ms": 0.0,
                                                              "engine_step_sequences": 0}])
    with pytest.raises(ValueError, match="context term"):
        calibrate.in_job_slowdown(alone.model_copy(update={"per_context_token_us": 0.1}),
                                  records)


def test_train_cost_predicts_the_measured_step_times():
    records = [{"trained_tokens": n, "train_s": 0.05 + n * 1e-4} for n in (800, 1200, 2000)]
    cost = calibrate.train_cost(records, cores=2, parameters=3.2e6)
    for r in records:
        assert cost.step_s(r["trained_tokens"], 2) == pytest.approx(r["train_s"])
    with pytest.raises(ValueError, match="does not grow"):
        calibrate.train_cost([{"trained_tokens": n, "train_s": 0.3 - n * 1e-5} for n in (1, 2)],
                             cores=1, parameters=1.0)


def test_the_length_model_draws_the_measured_quantiles_and_longest():
    records = [{"response_len_p10": 10, "response_len_p50": 40, "response_len_p90": 120,
                "response_len_max": 250}] * 3
    model = calibrate.length_model(records, max_tokens=256, prompt_tokens=16, batch_size=64)
    rng = random.Random(0)
    draws = sorted(model.sample(rng, model.group_median(rng), 0) for _ in range(20_000))
    for q, tokens in ((0.1, 10), (0.5, 40), (0.9, 120)):
        assert draws[int(q * len(draws))] == pytest.approx(tokens, rel=0.05)
    # The longest of a batch of 64 is the measured longest, about.
    longest = [max(model.sample(rng, 0, 0) for _ in range(64)) for _ in range(400)]
    assert sorted(longest)[200] == pytest.approx(250, rel=0.1)
    assert max(draws) <= 256
    with pytest.raises(ValueError, match="p10"):
        calibrate.length_model([{**records[0], "response_len_p10": 0}], 64, 16, 64)


def test_a_quantile_length_model_is_validated():
    from reflow.sim.costs import LengthModel

    with pytest.raises(ValueError, match="quantiles"):
        LengthModel(quantiles=[(0.5, 40), (0.4, 80)])
    with pytest.raises(ValueError, match="quantiles"):
        LengthModel(quantiles=[(0.1, 40), (0.9, 20)])
    with pytest.raises(ValueError, match="quantiles"):
        LengthModel(quantiles=[(0.1, 0), (0.9, 20)])


def test_sync_cost_is_the_measured_sync_less_its_wait_for_the_engines():
    cost = calibrate.sync_cost([{"weight_sync_s": 0.05, "sync_wait_s": 0.02},
                                {"weight_sync_s": 0.04}, {"weight_sync_s": 0.09}])
    assert cost.sync_s == pytest.approx(0.04, abs=1e-6)
    assert cost.colocate_switch_s == 0


def test_step_records_carry_the_batch_s_length_quantiles():
    assert _length_quantiles(list(range(1, 11))) == {
        "response_len_p10": 1, "response_len_p50": 5, "response_len_p90": 9,
        "response_len_max": 10}
    assert _length_quantiles([7]) == {"response_len_p10": 7, "response_len_p50": 7,
                                      "response_len_p90": 7, "response_len_max": 7}


def test_step_records_carry_the_engines_mean_decode_step():
    assert engine_step_fields(1.5, 300, 6000) == {"engine_step_ms": 5.0,
                                                  "engine_step_sequences": 20.0}
    assert engine_step_fields(0.0, 0, 0) == {}  # an engine that counts no steps


def test_the_rollout_delta_sums_the_generating_engines_and_restarts_a_replaced_one():
    totals = (1.0, 2.0, 100.0, 10.0, 3.0, 50.0, 4.0)
    before = {"a": (True, totals), "b": (True, totals), "c": (True, totals)}
    later = tuple(x * 2 for x in totals)
    now = {"a": (True, later),
           "b": (True, tuple(x / 2 for x in totals)),  # replaced: its counters began again
           "c": (False, later)}  # standing by: not generating now
    assert TrainLoop._rollout_delta(before, now) == [
        x + x / 2 for x in totals] + [2.0]


def _sandbox_bench(p50_ms: float, p99_ms: float) -> dict:
    rows = [{"program": program, "callers": callers, "path": path, "p50_ms": p50_ms * k,
             "p99_ms": p99_ms * k}
            for program, k in (("print(1)", 1), ("time.sleep(1)", 50))
            for callers in (1, 8, 32) for path in ("local", "grpc")]
    rows[0]["p50_ms"] = 1.0  # another row: the one asked for must be picked
    return {"rows": rows}


def test_tool_cost_puts_the_median_and_p99_where_the_sandbox_benchmark_measured_them():
    from reflow.sim.costs import ToolCost

    base = ToolCost(turns=3, output_tokens=64)
    tools = calibrate.tool_cost(_sandbox_bench(20.0, 60.0), base, callers=8)
    assert tools.latency_median_s == pytest.approx(0.020)
    # exp(z99 * sigma) = p99 / p50 = 3, and the rest of the section is kept.
    assert tools.latency_sigma == pytest.approx(math.log(3.0) / 2.3263478740408408)
    assert (tools.turns, tools.output_tokens) == (3, 64)
    draws = sorted(tools.latency_s(random.Random(k)) for k in range(20_000))
    assert draws[len(draws) // 2] == pytest.approx(0.020, rel=0.05)
    assert draws[int(0.99 * len(draws))] == pytest.approx(0.060, rel=0.1)
    # Only a local path measured: that one.
    local = {"rows": [r for r in _sandbox_bench(20.0, 20.0)["rows"] if r["path"] == "local"]}
    assert calibrate.tool_cost(local, base, callers=32).latency_sigma == 0.0


def test_tool_cost_refuses_what_is_not_a_sandbox_benchmark_row():
    from reflow.sim.costs import ToolCost

    with pytest.raises(ValueError, match="no `rows`"):
        calibrate.tool_cost({"seeds": []}, ToolCost())
    with pytest.raises(ValueError, match="no row for program 'print\\(1\\)' at 4 callers"):
        calibrate.tool_cost(_sandbox_bench(20.0, 60.0), ToolCost(), callers=4)


def test_reflow_sim_takes_the_tool_latency_from_a_benchmark_file(tmp_path, capsys):
    import json

    from reflow.sim.command import load_config, with_tool_latency

    bench = tmp_path / "sandbox.json"
    bench.write_text(json.dumps(_sandbox_bench(12.0, 36.0)))
    config = with_tool_latency(load_config(REPO / "examples" / "sim" / "python_tool.yaml"),
                               str(bench), 8)
    # The example's own figures are the committed benchmark's, at one caller.
    example = load_config(REPO / "examples" / "sim" / "python_tool.yaml").costs.tools
    measured = calibrate.tool_cost(json.loads((REPO / "bench" / "sim" / "sandbox_cpu.json")
                                              .read_text()), example)
    assert example.latency_median_s == pytest.approx(measured.latency_median_s, abs=5e-5)
    assert example.latency_sigma == pytest.approx(measured.latency_sigma, abs=5e-3)
    assert config.costs.tools.latency_median_s == pytest.approx(0.012)
    assert config.costs.tools.turns == 3
    assert "median 12.0 ms" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--tool-latency-from: .*no row"):
        with_tool_latency(config, str(bench), 5)
