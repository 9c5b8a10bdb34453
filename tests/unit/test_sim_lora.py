"""`reflow sim` with the job's `lora` section (reflow.sim.lora): an adapter's
size from the decoder's shape, and a LoRA job's weight syncs and role flips
priced by the adapter's bytes instead of the model's."""

import json
from pathlib import Path

import pytest
import redis

from reflow.core.config import JobSpecError
from reflow.core.lora_config import LoraConfig
from reflow.replay.embedded import EmbeddedRedis
from reflow.sim.command import load_config
from reflow.sim.costs import ModelShape
from reflow.sim.lora import adapter_parameters, transfers
from reflow.sim.plan import scaled_costs
from reflow.sim.run import Simulation, job_spec

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "examples" / "sim" / "qwen3_8b_lora.yaml"
# SmolLM2-135M's config.json.
SMOLLM2_135M = ModelShape(hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                          num_kv_heads=3, head_dim=64)


@pytest.fixture(scope="module")
def redis_client(tmp_path_factory):
    server = EmbeddedRedis(tmp_path_factory.mktemp("simredis"), appendonly=False).start()
    client = redis.Redis.from_url(server.url)
    yield client
    client.close()
    server.stop()


def _small(steps: int = 6, lora: bool = True, sync_overhead_s: float | None = None):
    """The LoRA example as a short job on short answers; `lora=False`: the same job
    fully fine-tuned."""
    config = load_config(EXAMPLE)
    job = dict(config.job)
    if not lora:
        job.pop("lora")
    costs = config.costs.model_copy(update={
        "lengths": config.costs.lengths.model_copy(update={"median_tokens": 300.0})})
    if sync_overhead_s is not None:
        costs = costs.model_copy(update={
            "sync": costs.sync.model_copy(update={"overhead_s": sync_overhead_s})})
    return config.model_copy(update={"job": job, "steps": steps, "warmup_steps": 1,
                                     "samples_per_gpu": 8, "costs": costs})


def test_the_adapter_of_smollm2_135m_counted_by_hand():
    # Rank 16 on all seven projections; each gets lora_A (16 x in) and lora_B (out x 16).
    # Attention: 9 heads x 64 = 576 wide, 3 KV heads x 64 = 192 wide.
    q = o = 16 * (576 + 576)         # 18,432 each
    k = v = 16 * (576 + 192)         # 12,288 each
    gate = up = down = 16 * (576 + 1536)  # 33,792 each
    per_block = q + k + v + o + gate + up + down  # 162,816
    assert per_block * 30 == 4_884_480  # PEFT's "trainable params" for this model and config
    assert adapter_parameters(SMOLLM2_135M, LoraConfig(rank=16)) == 4_884_480
    # Rank 8 on the query and value projections only.
    qv = LoraConfig(rank=8, target_modules=["q_proj", "v_proj"])
    assert adapter_parameters(SMOLLM2_135M, qv) == 30 * (8 * (576 + 576) + 8 * (576 + 192))


def test_the_default_shape_is_qwen3_8b_and_its_adapter_is_43_6m_parameters():
    shape = ModelShape()
    per_block = (2 * 16 * (4096 + 4096)      # q, o: 32 heads x 128
                 + 2 * 16 * (4096 + 1024)    # k, v: 8 KV heads x 128
                 + 3 * 16 * (4096 + 12288))  # gate, up, down
    assert adapter_parameters(shape, LoraConfig(rank=16)) == 36 * per_block == 43_646_976


def test_a_target_module_the_simulator_cannot_size_names_the_field():
    with pytest.raises(ValueError, match=r"lora.target_modules: .*'c_attn'.*q_proj"):
        adapter_parameters(SMOLLM2_135M, LoraConfig(target_modules=["q_proj", "c_attn"]))
    with pytest.raises(ValueError, match="num_kv_heads"):
        ModelShape(num_heads=4, num_kv_heads=8)


def test_the_sim_config_takes_the_job_spec_s_lora_section():
    config = load_config(EXAMPLE)
    spec = job_spec(config, "reflow", 8)
    assert isinstance(spec.lora, LoraConfig) and spec.lora.rank == 16
    bad = load_config(EXAMPLE, ["lora.rank=0"])
    with pytest.raises(JobSpecError, match="lora.rank"):
        job_spec(bad, "reflow", 8)
    assert job_spec(_small(lora=False), "reflow", 8).lora is None


def test_a_lora_job_s_sync_is_cheaper_by_the_bytes_ratio(redis_client, tmp_path):
    """Simulated on one config, with and without `lora`: each sync's pause (the
    sync less the wait for the engines to drain) is the bytes over the
    bandwidth, so without a fixed overhead the two stand in the bytes' ratio."""
    pauses, syncs = {}, {}
    for name, lora in (("full", False), ("lora", True)):
        config = _small(lora=lora, sync_overhead_s=0.0)
        sim = Simulation(config, "one_step_off", 4, redis_client, tmp_path / name, report=False)
        summary = sim.run()
        records = [json.loads(x) for x in
                   (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
        synced = [r for r in records if r["sync_s"] > 0]
        assert len(synced) == len(records) == config.steps
        pauses[name] = [r["sync_s"] - r["sync_wait_s"] for r in synced]
        syncs[name] = summary["weight_sync_bytes"]
        assert all(r["weight_sync_s"] == pytest.approx(p) for r, p in zip(synced, pauses[name]))
    costs = _small().costs
    adapter_bytes = adapter_parameters(costs.model, LoraConfig(rank=16)) \
        * costs.sync.weight_bytes / costs.train.parameters
    assert syncs == {"full": costs.sync.weight_bytes, "lora": adapter_bytes}
    ratio = adapter_bytes / costs.sync.weight_bytes
    assert ratio == pytest.approx(87.29e6 / 16.4e9, rel=1e-3)  # 43.6M bf16 parameters
    for full, lora in zip(pauses["full"], pauses["lora"]):
        assert full == pytest.approx(16.4e9 / 25e9)
        assert lora == pytest.approx(full * ratio)
    # With the stated overhead (the engines' pause, load and resume) only the
    # transfer shrinks.
    spec = job_spec(_small(), "one_step_off", 4)
    moved = transfers(costs, spec)
    assert moved.sync_s == pytest.approx(costs.sync.overhead_s + adapter_bytes / 25e9)
    full = transfers(costs, job_spec(_small(lora=False), "one_step_off", 4))
    assert full.sync_s == costs.sync.sync_s


def test_a_flip_moves_the_adapter_s_state_instead_of_the_model_s():
    """A flip's pause is FlipCost's measured one under full fine-tuning; with LoRA
    its state transfer (weights and two AdamW moments, sharded over the larger
    group under FSDP) is the adapter's."""
    config = _small()
    costs, flip = config.costs, config.costs.flip
    full = transfers(costs, job_spec(_small(lora=False), "reflow", 32))
    assert full.flip_pause_s(True, 8, 16) == flip.to_trainer_s
    assert full.flip_pause_s(False, 16, 8) == flip.to_rollout_s
    lora = transfers(costs, job_spec(config, "reflow", 32))
    assert lora.sharded  # an 8B model: trainer.parallelism auto shards it
    state, adapter_state = 3 * 16.4e9, 3 * lora.sync_bytes
    saved_s = (state - adapter_state) / 16 / 25e9  # one shard of the 16-rank group
    assert lora.flip_pause_s(True, 8, 16) == pytest.approx(flip.to_trainer_s - saved_s)
    assert lora.flip_pause_s(False, 16, 8) == pytest.approx(flip.to_rollout_s - saved_s)
    # Replicated: a joiner receives the whole state, a leaver hands over none.
    replicated = _small()
    replicated = replicated.model_copy(update={"job": {
        **replicated.job, "trainer": {**replicated.job["trainer"], "parallelism": "replicate"}}})
    lora = transfers(costs, job_spec(replicated, "reflow", 32))
    assert not lora.sharded
    assert lora.flip_pause_s(True, 8, 16) == pytest.approx(
        flip.to_trainer_s - (state - adapter_state) / 25e9)
    assert lora.flip_pause_s(False, 16, 8) == pytest.approx(flip.to_rollout_s)


def test_the_elastic_pool_s_flips_pause_for_the_adapter_s_state(redis_client, tmp_path):
    """Algorithm 1's flips in a simulated LoRA job: the trainer's pause at each
    boundary (the flip event's regroup_s) is the LoRA price, below Table 2's."""
    config = _small(24)
    config = config.model_copy(update={"job": {**config.job, "scheduler": {
        "placement_cooldown_steps": 2, "placement_min_gain": 0.0}}})
    sim = Simulation(config, "reflow", 8, redis_client, tmp_path / "reflow", report=False)
    summary = sim.run()
    events = [json.loads(x) for x in
              (tmp_path / "reflow" / "scheduler_events.jsonl").read_text().splitlines()]
    flips = [e for e in events if e["event"] == "role_flip"]
    assert flips and summary["role_flips"] == len(flips)
    flip = config.costs.flip
    for f in flips:
        measured = flip.to_trainer_s if f["to"] == "trainer" else flip.to_rollout_s
        assert 0 < f["regroup_s"] < measured


def test_the_planner_widens_the_shape_with_the_model_size():
    costs = load_config(EXAMPLE).costs
    assert scaled_costs(costs, costs.train.parameters).model == costs.model
    wide = scaled_costs(costs, 4 * costs.train.parameters)
    assert (wide.model.hidden_size, wide.model.intermediate_size, wide.model.num_heads,
            wide.model.num_kv_heads, wide.model.head_dim, wide.model.num_layers) \
        == (8192, 24576, 64, 16, 128, 36)
    lora = LoraConfig(rank=16)
    # An adapter grows with the width: twice as wide, twice the adapter.
    assert adapter_parameters(wide.model, lora) == 2 * adapter_parameters(costs.model, lora)
