"""An AsyncHybrid worker's GPU (rollout/memory.py), without a GPU: the engine's
share sized with the warm trainer half, refusals that name the field to change,
and vLLM's sleep mode called in the right order around standby and weight
updates (a fake AsyncLLM records the calls a CUDA engine would get)."""

import asyncio

import pytest
import torch

from reflow.core.config import parse_job_spec
from reflow.rollout.memory import EngineSleep, ModelShape, plan_hybrid_gpu
from reflow.rollout.vllm_engine import VllmEngine

GIB = 2**30
# Qwen3-8B (the paper's model) and an H200's 139 GiB.
QWEN3_8B = ModelShape(parameters=8_190_735_360, hidden_size=4096, num_layers=36)
H200 = 139 * GIB


def _spec(**sections):
    return parse_job_spec({"model": {"path": "/m", "dtype": "bfloat16"},
                           "cluster": {"workers": 4, "trainer_workers": 2}, **sections})


def test_the_parameter_count_is_read_from_the_checkpoint_headers(tiny_model):
    from transformers import AutoModelForCausalLM

    shape = ModelShape.read(tiny_model)
    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    assert shape.parameters == sum(p.numel() for p in model.parameters())
    assert (shape.hidden_size, shape.num_layers) == (model.config.hidden_size,
                                                     model.config.num_hidden_layers)


def test_the_engine_gets_what_the_warm_trainer_half_leaves():
    plan = plan_hybrid_gpu(H200, QWEN3_8B, _spec())
    # bf16 weights, gradients and both AdamW moments: 8 bytes a parameter.
    assert plan.trainer_state == QWEN3_8B.parameters * 8
    assert plan.engine_weights == QWEN3_8B.parameters * 2
    engine = plan.engine_utilization * H200
    assert plan.headroom + plan.trainer_state + engine <= H200 * 1.0001
    assert plan.kv_cache == pytest.approx(engine - plan.engine_weights, rel=1e-3)
    # The trainer's activations live where the sleeping engine's KV cache was.
    assert 0 < plan.trainer_activations <= plan.kv_cache
    assert plan.sleep_mode
    assert 0.4 < plan.engine_utilization < 0.55  # 1 - 0.05 - 61 GiB / 139 GiB


def test_halves_that_do_not_fit_are_refused_by_the_field_to_change():
    fp32 = parse_job_spec({"model": {"path": "/m", "dtype": "float32"},
                           "cluster": {"workers": 2}})
    with pytest.raises(ValueError, match="model.dtype: bfloat16"):
        plan_hybrid_gpu(80 * GIB, QWEN3_8B, fp32)  # 131 GB of fp32 state on an 80 GB GPU
    with pytest.raises(ValueError, match="rollout.gpu_memory_utilization: .* at 0.9"):
        plan_hybrid_gpu(H200, QWEN3_8B, _spec(rollout={"gpu_memory_utilization": 0.9}))
    long = {"max_tokens_per_micro_batch": 65536}
    with pytest.raises(ValueError, match="trainer.max_tokens_per_micro_batch: 65536"):
        plan_hybrid_gpu(H200, QWEN3_8B, _spec(trainer=long))
    # Recomputed activations fit.
    plan_hybrid_gpu(H200, QWEN3_8B, _spec(trainer={**long, "activation_checkpointing": True}))
    # An engine that keeps its KV cache leaves the activations room beside it.
    awake = plan_hybrid_gpu(H200, QWEN3_8B, _spec(rollout={"sleep_mode": "off"}))
    asleep = plan_hybrid_gpu(H200, QWEN3_8B, _spec())
    assert not awake.sleep_mode
    assert awake.kv_cache == pytest.approx(asleep.kv_cache - asleep.trainer_activations,
                                           abs=2)


class FakeAsyncLLM:
    """The AsyncLLM calls a sleeping engine gets, in order."""

    def __init__(self) -> None:
        self.calls: list[tuple] = []
        self.busy = False

    async def reset_prefix_cache(self):
        self.calls.append(("reset_prefix_cache",))
        return not self.busy

    async def sleep(self, level=1):
        self.calls.append(("sleep", level))

    async def wake_up(self, tags=None):
        self.calls.append(("wake_up", tags))
        return True

    async def collective_rpc(self, method, args=()):
        self.calls.append(("collective_rpc", method))
        return [0.5]


def _engine(fake: FakeAsyncLLM) -> VllmEngine:
    engine = object.__new__(VllmEngine)  # what VllmEngine(sleep_mode=True) holds on a GPU
    engine._engine, engine._sleep, engine.tensor_parallel_size = fake, EngineSleep(fake), 1
    return engine


def test_standby_sleeps_an_update_wakes_the_weights_and_leaving_wakes_the_cache(monkeypatch):
    free = iter([10 * GIB, 40 * GIB])
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda: (next(free), H200))
    fake = FakeAsyncLLM()
    engine = _engine(fake)
    released = asyncio.run(engine.release_memory())
    assert released["released"] == 30 * GIB
    assert fake.calls == [("reset_prefix_cache",), ("sleep", 1)]
    # Standby again (a retried flip): already asleep, nothing called.
    asyncio.run(engine._sleep.sleep())
    assert len(fake.calls) == 2
    # A weight update while asleep: the weights come back before the broadcast.
    assert asyncio.run(engine.receive_weights()) == 0.5
    assert asyncio.run(engine.receive_weights()) == 0.5  # awake weights: straight in
    assert fake.calls[2:] == [("wake_up", ["weights"]),
                              ("collective_rpc", "reflow_receive_weights"),
                              ("collective_rpc", "reflow_receive_weights")]
    # Leaving standby: only the KV cache still sleeps.
    asyncio.run(engine.restore_memory())
    assert fake.calls[5:] == [("wake_up", ["kv_cache"])]
    assert not engine._sleep.asleep
    asyncio.run(engine.restore_memory())  # awake: nothing
    assert len(fake.calls) == 6
    assert set(engine._sleep.timings) == {"sleep_s", "wake_weights_s", "wake_s"}


def test_an_engine_that_slept_through_no_update_wakes_whole_and_a_busy_one_stays_awake():
    fake = FakeAsyncLLM()
    sleep = EngineSleep(fake)
    asyncio.run(sleep.sleep())
    asyncio.run(sleep.wake())
    assert fake.calls == [("reset_prefix_cache",), ("sleep", 1), ("wake_up", None)]
    fake.busy = True
    with pytest.raises(RuntimeError, match="still runs requests"):
        asyncio.run(sleep.sleep())
    assert not sleep.asleep and fake.calls[-1] == ("reset_prefix_cache",)


def test_a_worker_leaving_standby_restores_the_engine_before_it_admits():
    from reflow.rollout.worker import RolloutWorker
    from reflow.tasks import TaskContext
    from reflow.tasks.repeat import RepeatTask

    from tests.unit.fake_engines import PausableEngine

    seen: list[tuple[str, bool]] = []

    class Engine(PausableEngine):
        async def release_memory(self):
            seen.append(("release", worker.standby))
            return {"released": 0, "rss_before": 0, "rss_after": 0}

        async def restore_memory(self):
            seen.append(("restore", worker.standby))

    spec = parse_job_spec({"model": {"path": "/m"}, "rollout": {"group_size": 2},
                           "trainer": {"batch_size": 4}})
    worker = RolloutWorker("j", spec, Engine, RepeatTask(8, 3, context=TaskContext(seed=0)),
                           None, encode=lambda text: [1], decode=lambda ids: "a")
    worker.start()
    try:
        worker.wait_ready(10)
        worker.set_standby(True)
        worker.set_standby(False)
    finally:
        worker.stop()
    # Released once standing by; restored while still standing by, then admitting.
    assert seen == [("release", True), ("restore", True)]
    assert not worker.standby


@pytest.mark.parametrize("content", [
    b"", b"\x01\x02",  # shorter than the header's length
    (2**40).to_bytes(8, "little") + b"{}",  # a header length far past the bound
    (7).to_bytes(8, "little") + b"{not js",
    (30).to_bytes(8, "little") + b'{"w": {"shape": ["9", 2]}}    ',
    (12).to_bytes(8, "little") + b'{"w": [1, 2]}',
])
def test_a_file_that_is_not_safetensors_is_refused_by_name(tmp_path, content):
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "num_hidden_layers": 2}')
    (tmp_path / "model.safetensors").write_bytes(content)
    with pytest.raises(ValueError, match="model.safetensors: not a safetensors"):
        ModelShape.read(tmp_path)


def test_a_model_directory_without_shape_or_weights_is_refused(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": "8"}')
    with pytest.raises(ValueError, match="no integer hidden_size"):
        ModelShape.read(tmp_path)
    (tmp_path / "config.json").write_text('{"hidden_size": 8, "num_hidden_layers": 2}')
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        ModelShape.read(tmp_path)
