"""`reflow sim` (reflow.sim): the product's dispatcher and replay buffer (its
Lua scripts on a real embedded Redis) on a virtual clock, with simulated
engines and trainer; each mode keeps its guarantee there as in a real run, and
the simulator holds no copy of the control code it drives."""

import ast
import json
from argparse import Namespace
from pathlib import Path

import pytest
import redis

import reflow.sim
from reflow.replay.embedded import EmbeddedRedis
from reflow.replay.store import ReplayStore
from reflow.report import read_metrics, summarize
from reflow.scheduler.generation.dispatch import Dispatcher
from reflow.scheduler.placement.elastic import ElasticPool
from reflow.scheduler.generation.concurrency import ConcurrencyController
from reflow.scheduler.placement.planner import PlacementPlanner
from reflow.scheduler.placement.feed import PlacementFeed
from reflow.sim.command import load_config, main, table
from reflow.sim.costs import DecodeCost, SimConfig
from reflow.sim.run import Simulation

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "sim" / "qwen3_8b.yaml"


def _small(steps: int = 6) -> SimConfig:
    config = load_config(EXAMPLE)
    # A shorter job on shorter answers: the modes' guarantees, not their speeds.
    return config.model_copy(update={
        "steps": steps, "warmup_steps": 1, "samples_per_gpu": 8,
        "costs": config.costs.model_copy(update={
            "lengths": config.costs.lengths.model_copy(update={"median_tokens": 300.0})})})


@pytest.fixture(scope="module")
def redis_client(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("simredis"), appendonly=False).start()
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()
    server.stop()


def _run(mode, redis_client, tmp_path, gpus=4, config=None):
    sim = Simulation(config or _small(), mode, gpus, redis_client, tmp_path / mode)
    return sim, sim.run()


def test_the_simulation_drives_the_products_dispatcher_and_buffer(redis_client, tmp_path):
    sim, summary = _run("reflow", redis_client, tmp_path)
    assert type(sim.dispatcher) is Dispatcher
    assert type(sim.dispatcher.controller) is ConcurrencyController
    assert type(sim.replay.store) is ReplayStore
    # The dispatcher decided on virtual time: its clock is the simulation's.
    assert sim.dispatcher.clock is sim.clock
    assert sim.clock.now == pytest.approx(summary["simulated_s"], abs=1e-3) and sim.clock.now > 20
    # Groups went through the buffer's budget and the dispatcher's routing.
    assert sum(sim.dispatcher.dispatched_groups.values()) * 16 >= 6 * 32
    assert redis_client.keys("reflow:{sim}:*")
    records = [json.loads(x) for x in (tmp_path / "reflow" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 7))
    assert json.loads((tmp_path / "reflow" / "summary.json").read_text()) == summary


def test_no_simulator_only_copy_of_the_control_code():
    """The classes and functions the simulator drives are imported, never defined
    in reflow.sim: a copy there would let the simulation drift from the product."""
    control = {"Dispatcher", "ReplayStore", "ConcurrencyController", "LengthEstimator",
               "WorkerLoad", "route", "PlacementPlanner", "PlacementPolicy", "DispatchLedger",
               "acquire_dispatch", "dispatch_limits", "InprocReplayClient", "PlacementFeed",
               "planner_for", "WindowMeasurement", "blocked_worker_seconds", "ElasticPool",
               "FlipRequest", "JobEnded", "rebalance", "schedule"}
    package = Path(reflow.sim.__file__).parent
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        defined = {n.name for n in ast.walk(tree)
                   if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))}
        assert not defined & control, (path.name, defined & control)
    import reflow.sim.run as run

    assert run.Dispatcher is Dispatcher and run.ReplayStore is ReplayStore
    assert run.PlacementFeed is PlacementFeed and run.ElasticPool is ElasticPool
    # Nor a class in reflow.sim that carries flips out itself: its only pool is the
    # product's (a sim-side rebalance or flip queue would be a copy).
    for path in package.glob("*.py"):
        tree = ast.parse(path.read_text())
        for cls in (n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)):
            methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef)}
            assert not methods & {"rebalance", "at_boundary", "request"}, \
                (path.name, cls.name)


def test_each_mode_keeps_its_staleness_and_replay_bounds(redis_client, tmp_path):
    """As a real run keeps them (tests/e2e/test_cli.py), from each sample's oldest
    segment: sync 0, one_step_off 1, fully_async unbounded (partial rollout), reflow
    δ = 1 when versions are counted from the oldest segment; replay only in reflow,
    at most σ of a batch."""
    config = _small(8)
    for mode, most_stale in (("sync", 0), ("one_step_off", 1), ("fully_async", None)):
        sim, summary = _run(mode, redis_client, tmp_path, config=config)
        if most_stale is not None:
            assert max(int(k) for r in sim.records for k in r["staleness_histogram"]) \
                == most_stale, mode
        assert summary["replay_fraction"] == 0.0, mode
    job = {**config.job, "replay": {**config.job["replay"], "staleness_version": "oldest"}}
    sim, summary = _run("reflow", redis_client, tmp_path,
                        config=config.model_copy(update={"job": job}))
    assert max(int(k) for r in sim.records for k in r["staleness_histogram"]) <= 1
    sigma = sim.spec.replay.replay_cap
    assert all(r["replay_samples"] <= sigma * sim.spec.trainer.batch_size for r in sim.records)
    assert summary["replay_fraction"] > 0


def test_step_records_count_the_tokens_trained_for_the_first_time(redis_client, tmp_path):
    """first_use_tokens (trainer/records.py): a replayed sample's tokens count in
    trained_tokens again, not in first_use_tokens; the summary's rate is theirs."""
    sim, summary = _run("reflow", redis_client, tmp_path, config=_small(8))
    replayed = [r for r in sim.records if r["replay_samples"]]
    assert replayed  # reflow replays: some step trains a sample again
    for r in sim.records:
        assert r["first_use_tokens_per_s"] == pytest.approx(
            r["first_use_tokens"] / r["step_time_s"])
        if r["replay_samples"]:
            assert 0 < r["first_use_tokens"] < r["trained_tokens"]
        else:
            assert r["first_use_tokens"] == r["trained_tokens"]
    measured = sim.records[sim.config.warmup_steps:]
    assert summary["first_use_tokens_per_s"] == pytest.approx(
        sum(r["first_use_tokens"] for r in measured) / sum(r["step_time_s"] for r in measured))
    assert summary["first_use_tokens_per_s"] < summary["throughput_tokens_per_s"]


def test_the_modes_table_shows_first_use_tokens_per_second():
    row = {"throughput_tokens_per_s": 1200.0, "trainer_idle_ratio": 0.1,
           "rollout_idle_ratio": 0.2, "mean_staleness": 0.5, "replay_fraction": 0.25,
           "wall_s": 1.0}
    lines = table({"8": {"sync": {**row, "throughput_tokens_per_s": 1000.0,
                                  "first_use_tokens_per_s": 1000.0},
                         "reflow": {**row, "first_use_tokens_per_s": 900.0},
                         "fully_async": row}}).splitlines()  # an older run's summary
    assert lines[0].split()[:5] == ["gpus", "mode", "tokens/s", "first-use/s", "vs"]
    assert lines[2].split()[:5] == ["8", "reflow", "1200", "900", "1.20"]
    assert lines[3].split()[:5] == ["8", "fully_async", "1200", "-", "1.20"]


def test_one_seed_one_result(redis_client, tmp_path):
    _, first = _run("fully_async", redis_client, tmp_path / "a")
    _, second = _run("fully_async", redis_client, tmp_path / "b")
    first.pop("wall_s"), second.pop("wall_s")
    assert first == second


def test_decode_steps_and_their_inverse_agree():
    cost = DecodeCost()
    for running, context in ((1, 600), (64, 40_000), (256, 370_000)):
        for steps in (1, 7, 500):
            t = cost.steps_time_s(running, context, steps)
            assert cost.steps_within(running, context, t) == steps
            assert cost.steps_within(running, context, t * 0.999) == steps - 1 or steps == 1
    # The published H100 point at 64 concurrent requests, within the fit's residual.
    assert cost.steps_time_s(64, 0, 1) == pytest.approx(0.0469, rel=0.05)


def test_step_records_give_the_engines_mean_decode_step_as_a_real_run_s_do(redis_client,
                                                                          tmp_path):
    """engine_step_ms and engine_step_sequences (trainer/records.py): with no context
    or prefill term the decode model is linear in the batch, so the mean step is
    the model's step at the mean batch, exactly."""
    config = _small()
    decode = config.costs.decode.model_copy(update={"per_context_token_us": 0.0,
                                                    "prefill_per_token_us": 0.0})
    config = config.model_copy(update={"costs": config.costs.model_copy(update={"decode": decode})})
    _run("fully_async", redis_client, tmp_path, config=config)
    records = [json.loads(x) for x in
               (tmp_path / "fully_async" / "metrics.jsonl").read_text().splitlines()]
    for r in records:
        assert r["engine_step_sequences"] > 1
        assert r["engine_step_ms"] == pytest.approx(
            decode.floor_ms + decode.per_sequence_ms * r["engine_step_sequences"], rel=1e-9)
        assert 0 < r["rollout_busy_ratio"] <= 1
        assert r["rollout_busy_ratio"] >= r["rollout_utilisation"] - 1e-9


def test_the_command_writes_each_run_and_the_table(tmp_path, capsys):
    config = tmp_path / "sim.yaml"
    data = _small(6).model_dump(mode="json")
    import yaml

    config.write_text(yaml.safe_dump(data))
    assert main(Namespace(config=str(config), gpus="4", modes="sync,reflow",
                          out=str(tmp_path / "out"))) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(results["4"]) == {"sync", "reflow"}
    run = tmp_path / "out" / "4gpus" / "reflow"
    # A real run's artefacts, read by a real run's summariser.
    assert (run / "report.png").stat().st_size > 10_000
    headline = summarize(read_metrics(run / "metrics.jsonl"))
    assert headline["steps"] == 6 and headline["trained_tokens"] > 0
    assert headline["wall_time_s"] == pytest.approx(results["4"]["reflow"]["simulated_s"], abs=1e-3)
    assert 0 <= headline["reward_last_mean"] <= 1 and headline["max_staleness"] >= 0
    table = capsys.readouterr().out
    assert "vs sync" in table and "reflow" in table
    # An ablation is an override of the job: replay off.
    assert main(Namespace(config=str(config), gpus="4", modes="reflow", out=str(tmp_path / "ab"),
                          overrides=["replay.replay_cap=0"])) == 0
    ablated = json.loads((tmp_path / "ab" / "results.json").read_text())["4"]["reflow"]
    assert ablated["replay_fraction"] == 0.0 < results["4"]["reflow"]["replay_fraction"]


def test_several_seeds_give_each_seed_s_runs_and_their_spread(tmp_path, capsys):
    import yaml

    config = tmp_path / "sim.yaml"
    config.write_text(yaml.safe_dump(_small(6).model_dump(mode="json")))
    assert main(Namespace(config=str(config), gpus="4", modes="sync,reflow", seeds="0,1",
                          out=str(tmp_path / "out"))) == 0
    results = json.loads((tmp_path / "out" / "results.json").read_text())
    assert set(results["seeds"]) == {"0", "1"}
    runs = [results["seeds"][k]["4"]["reflow"]["throughput_tokens_per_s"] for k in ("0", "1")]
    assert runs[0] != runs[1]  # two draws of the lengths, not one run twice
    tokens = results["spread"]["4"]["reflow"]["throughput_tokens_per_s"]
    assert (tokens["min"], tokens["max"], tokens["n"]) == (min(runs), max(runs), 2)
    ratios = [results["seeds"][k]["4"]["reflow"]["throughput_tokens_per_s"]
              / results["seeds"][k]["4"]["sync"]["throughput_tokens_per_s"] for k in ("0", "1")]
    assert results["spread"]["4"]["reflow"]["vs_sync"]["max"] == pytest.approx(max(ratios))
    assert (tmp_path / "out" / "seed1" / "4gpus" / "reflow" / "metrics.jsonl").exists()
    assert results["spread"]["4"]["reflow"]["first_use_tokens_per_s"]["n"] == 2
    printed = capsys.readouterr().out
    assert "over seeds 0,1" in printed and "first-use tokens/s" in printed
    with pytest.raises(SystemExit, match="--seeds"):
        main(Namespace(config=str(config), gpus="4", modes="sync", seeds="0,x",
                       out=str(tmp_path / "bad")))
    with pytest.raises(SystemExit, match="repeats"):
        main(Namespace(config=str(config), gpus="4", modes="sync", seeds="1,1",
                       out=str(tmp_path / "bad")))


def test_a_bad_config_names_its_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("job: {}\ncosts: {decode: {floor_ms: -1}}\n")
    with pytest.raises(ValueError, match="floor_ms"):
        load_config(bad)
    bad.write_text("job: {}\nstep: 3\n")
    with pytest.raises(ValueError, match="step"):
        load_config(bad)
    # Overrides: the job's sections, or the sim config's own fields, validated once.
    config = load_config(EXAMPLE, ["samples_per_gpu=256", "costs.train.utilisation=0.2",
                                   "replay.max_staleness=2", "steps=30"])
    assert (config.samples_per_gpu, config.costs.train.utilisation, config.steps) == (256, 0.2, 30)
    assert config.job["replay"]["max_staleness"] == 2
    assert config.costs.decode == load_config(EXAMPLE).costs.decode
    with pytest.raises(ValueError, match="utilisation"):
        load_config(EXAMPLE, ["costs.train.utilisation=2"])
    with pytest.raises(ValueError, match="samples_per_gpu"):
        load_config(EXAMPLE, ["samples_per_gpu=0"])
    with pytest.raises(ValueError, match="warp"):
        load_config(EXAMPLE, ["costs.train.warp=1"])
    with pytest.raises(ValueError, match="not a section"):
        load_config(EXAMPLE, ["steps.count=1"])
    # YAML's tags that would build Python objects are refused, naming the override.
    with pytest.raises(ValueError, match="override 'costs.train.utilisation'"):
        load_config(EXAMPLE, ["costs.train.utilisation=!!python/object/apply:os.getpid []"])
    with pytest.raises(ValueError, match="override 'replay.replay_cap'"):
        load_config(EXAMPLE, ["replay.replay_cap=!!python/object/apply:os.getpid []"])
    bad.write_text("job: !!python/name:os.system\n")
    with pytest.raises(ValueError, match="not YAML"):
        load_config(bad)
    with pytest.raises(SystemExit, match="--modes"):
        main(Namespace(config=str(EXAMPLE), gpus="4", modes="async", out=str(tmp_path)))


def test_algorithm_1_moves_the_elastic_pool_and_placement_off_keeps_the_split(redis_client,
                                                                              tmp_path):
    """Reflow's GPUs are an elastic pool: each step's record goes to the product's
    PlacementFeed and PlacementPlanner, and the product's ElasticPool, driven on
    the virtual clock, carries its rebalances out through the flip protocol (the
    dispatcher's standby, the worker's role, the leader's membership at a sync
    boundary), never doubling a GPU and with at most one unit in transit (between
    its drain and the boundary). With scheduler.placement off (the ablation) the
    split stays as it started."""
    config = _small(24)
    config = config.model_copy(update={"job": {**config.job, "scheduler": {
        **config.job.get("scheduler", {}), "placement_cooldown_steps": 2,
        "placement_min_gain": 0.0}}})
    sim, summary = _run("reflow", redis_client, tmp_path, gpus=8, config=config)
    assert type(sim.feed.planner) is PlacementPlanner
    assert type(sim.pool) is ElasticPool and sim.pool.clock is sim.clock
    assert sim.feed.pool is sim.pool and sim.pool.error == ""
    records = [json.loads(x) for x in (tmp_path / "reflow" / "metrics.jsonl").read_text().splitlines()]
    assert all(0.0 <= r["rollout_blocked_ratio"] <= 1.0 for r in records)
    units = [r["rollout_workers"] + r["trainer_workers"] for r in records]
    assert set(units) <= {7, 8} and units.count(8) > len(units) // 2
    assert all(r["trainer_gpus"] == r["trainer_workers"] for r in records)  # 1 GPU a unit
    events = [json.loads(x) for x in
              (tmp_path / "reflow" / "scheduler_events.jsonl").read_text().splitlines()]
    moved = [e for e in events if e["event"] == "placement" and e["carried_out"]]
    flips = [e for e in events if e["event"] == "role_flip"]
    assert moved and summary["role_flips"] == len(flips) == sim.pool.flips_done >= len(moved)
    assert {f["reason"] for f in flips} <= {"placement: more_rollout", "placement: more_trainer"}
    assert {f["to"] for f in flips} == {"rollout", "trainer"}
    # Each flip's phases on the virtual clock: the wait for the boundary, the
    # trainer's pause (FlipCost) as the leader's regroup time, the epochs in order.
    flip_cost = sim.costs.flip
    for f in flips:
        assert f["regroup_s"] == (flip_cost.to_trainer_s if f["to"] == "trainer"
                                  else flip_cost.to_rollout_s)
        assert f["wait_boundary_s"] >= 0 and f["total_s"] >= f["regroup_s"]
    assert [f["membership_epoch"] for f in flips] == list(range(1, len(flips) + 1))
    assert {e["event"] for e in events} >= {"worker_standby", "worker_admitting"}
    assert len({r["rollout_workers"] for r in records}) > 1

    off = config.model_copy(update={"job": {**config.job, "scheduler": {
        **config.job["scheduler"], "placement": False}}})
    sim, summary = _run("reflow", redis_client, tmp_path / "off", gpus=8, config=off)
    assert sim.pool is None and summary["role_flips"] == 0
    records = [json.loads(x) for x in
               (tmp_path / "off" / "reflow" / "metrics.jsonl").read_text().splitlines()]
    assert {r["rollout_workers"] for r in records} == {6}


def test_the_planner_scales_the_cost_model_with_the_model_size():
    from reflow.sim.plan import parse_size, scaled_costs

    assert parse_size("8B") == 8e9 and parse_size("135M") == 1.35e8
    with pytest.raises(ValueError, match="--model-size"):
        parse_size("8 bytes")
    with pytest.raises(ValueError, match="outside"):
        parse_size("5000B")
    costs = load_config(EXAMPLE).costs
    same = scaled_costs(costs, costs.train.parameters)
    assert same.decode.floor_ms == pytest.approx(costs.decode.floor_ms)
    assert same.decode.kv_capacity_tokens == pytest.approx(costs.decode.kv_capacity_tokens, rel=1e-6)
    double = scaled_costs(costs, 2 * costs.train.parameters)
    assert double.gpus_per_engine == 1  # 33 GB of weights still fit beside a KV cache
    assert double.decode.floor_ms == pytest.approx(2 * costs.decode.floor_ms)
    assert double.sync.weight_bytes == pytest.approx(2 * costs.sync.weight_bytes)
    assert double.decode.kv_capacity_tokens < costs.decode.kv_capacity_tokens / 2
    big = scaled_costs(costs, 70e9)  # 143 GB of weights: 4 GPUs an engine
    assert big.gpus_per_engine == 4
    assert big.decode.floor_ms == pytest.approx(costs.decode.floor_ms * 70e9 / 8.2e9 / 4)
    assert big.decode.kv_capacity_tokens > 0


def test_the_planner_searches_and_writes_every_candidate(tmp_path, capsys):
    from reflow.sim.plan import main as plan_main

    assert plan_main(["--model-size", "8B", "--gpus", "4", "--workload", str(EXAMPLE),
                      "--steps", "3", "--top", "2", "--out", str(tmp_path)]) == 0
    plan = json.loads((tmp_path / "plan.json").read_text())
    rows = plan["candidates"]
    # The coordinate search: the splits 4 GPUs can make (2:2, 3:1; 1/2 and 5/8 round
    # to one, 7/8 leaves no trainer), then 2 more σ, 1 more δ, sync interval, B_max.
    assert len(rows) == 7
    speeds = [r["throughput_tokens_per_s"] for r in rows]
    assert speeds == sorted(speeds, reverse=True) and speeds[0] > 0
    assert {r["split"] for r in rows} >= {"2:2", "3:1"}
    printed = capsys.readouterr().out
    assert "best 2" in printed and len(printed.strip().splitlines()) == 4


def test_multi_turn_episodes_wait_out_their_tool_calls(redis_client, tmp_path):
    """Three turns a response, two tool calls of 20 s between them (no spread): every
    episode leaves the batch twice, comes back with 64 tokens of tool output in its
    prompt, and the job's first batch cannot be ready before 40 s of tool time."""
    from reflow.sim.costs import ToolCost

    base = _small(4)
    tools = ToolCost(turns=3, latency_median_s=20.0, latency_sigma=0.0, output_tokens=64)
    multi = base.model_copy(update={"costs": base.costs.model_copy(update={"tools": tools})})
    _, single_summary = _run("reflow", redis_client, tmp_path / "one", config=base)
    sim, multi_summary = _run("reflow", redis_client, tmp_path / "three", config=multi)
    prompts = {p for p, _ in sim.sample_tokens.values()}
    assert prompts == {base.costs.lengths.prompt_tokens + 2 * 64}
    records = [json.loads(x) for x in
               (tmp_path / "three" / "reflow" / "metrics.jsonl").read_text().splitlines()]
    assert records[0]["time_s"] >= 40.0
    assert multi_summary["simulated_s"] > single_summary["simulated_s"] + 40.0
    assert multi_summary["steps"] == single_summary["steps"] == 4


def test_tool_calls_that_return_during_a_weight_sync_do_not_stall_the_run(redis_client,
                                                                           tmp_path):
    """Tool calls of milliseconds (the sandbox's, examples/sim/python_tool.yaml) return
    while engines are paused for a weight sync: each waits for the pause to end, and
    the run goes on to its last step (it once waited for ever on such a return)."""
    from reflow.sim.costs import ToolCost

    base = _small(6)
    tools = ToolCost(turns=3, latency_median_s=0.015, latency_sigma=0.3, output_tokens=64)
    multi = base.model_copy(update={"costs": base.costs.model_copy(update={"tools": tools})})
    for mode in ("reflow", "sync"):
        _, summary = _run(mode, redis_client, tmp_path / mode, config=multi)
        assert summary["steps"] == 6


def test_a_sync_step_s_stragglers_show_in_its_tail_share(redis_client, tmp_path):
    """Nine in ten samples of 10-20 tokens and one in twenty of 2,000: in sync, the
    last tenth holds the batch for most of the generation phase; samples all of
    one length end together. 256 samples a step, so a step's tenth is 25 of them."""
    config = _small().model_copy(update={"samples_per_gpu": 64})
    lengths = config.costs.lengths.model_copy(update={
        "quantiles": [(0.1, 10.0), (0.9, 20.0), (0.95, 2000.0)], "max_tokens": 2000})
    config = config.model_copy(update={"costs": config.costs.model_copy(update={"lengths": lengths})})
    _, summary = _run("sync", redis_client, tmp_path, config=config)
    assert 0.75 < summary["rollout_tail_share"] < 1.0
    even = config.costs.lengths.model_copy(update={"quantiles": [(0.5, 200.0), (1.0, 200.0)],
                                                   "max_tokens": 2000})
    config = config.model_copy(update={"costs": config.costs.model_copy(update={"lengths": even})})
    _, summary = _run("sync", redis_client, tmp_path / "even", config=config)
    assert summary["rollout_tail_share"] < 0.05
