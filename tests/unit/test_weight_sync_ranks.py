"""Ranks of tensor-parallel engines in the weight-sync group, the checks on a
WeightSyncSpec that describe them, and the refusal of an NCCL join on the
trainer's own GPU."""

import dataclasses
import threading
from types import SimpleNamespace

import pytest
import torch

from reflow.procs import free_port
from reflow.rollout.engine import WeightSyncSpec
from reflow.weightsync import (
    RankPlan,
    check_distinct_gpus,
    engine_worker_rank,
    make_group,
    new_rendezvous_key,
    receive_weights,
    send_weights,
    specs_of,
    worker_init_weight_sync,
)

MiB = 1 << 20
KEY = "0123456789abcdef0123456789abcdef"


@pytest.mark.parametrize(
    ("engine_tp_sizes", "engine_ranks", "world_size"),
    [
        ([], [], 1),
        ([1], [[1]], 2),
        ([1, 1, 1], [[1], [2], [3]], 4),
        ([2], [[1, 2]], 3),
        ([2, 2], [[1, 2], [3, 4]], 5),
        ([2, 1, 4], [[1, 2], [3], [4, 5, 6, 7]], 8),
    ],
)
def test_rank_plan_gives_every_tp_worker_its_own_rank(engine_tp_sizes, engine_ranks, world_size):
    plan = RankPlan.for_engines(engine_tp_sizes)
    assert [list(r) for r in plan.engine_ranks] == engine_ranks
    assert plan.world_size == world_size
    assert [plan.first_rank(i) for i in range(len(engine_tp_sizes))] == [r[0] for r in engine_ranks]


def test_rank_plan_with_tp_1_is_engine_i_at_rank_i_plus_1():
    plan = RankPlan.for_engines([1] * 5)
    assert [plan.first_rank(i) for i in range(5)] == [i + 1 for i in range(5)]
    assert plan.world_size == 1 + 5


@pytest.mark.parametrize("size", [0, -1])
def test_rank_plan_refuses_a_tp_size_below_1(size):
    with pytest.raises(ValueError, match=r"engine_tp_sizes\[1\]"):
        RankPlan.for_engines([1, size])


@pytest.mark.parametrize(
    ("first_rank", "tp_size", "tp_rank", "tp_world", "world_size", "expected"),
    [
        (1, 1, 0, 1, 2, 1),
        (3, 2, 0, 2, 5, 3),
        (3, 2, 1, 2, 5, 4),
    ],
)
def test_engine_worker_rank(first_rank, tp_size, tp_rank, tp_world, world_size, expected):
    assert engine_worker_rank(first_rank, tp_size, tp_rank, tp_world, world_size) == expected


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((1, 2, 0, 1, 3), "tensor_parallel_size: 2 but this engine runs 1"),
        ((1, 2, 2, 2, 3), "tensor-parallel rank 2 is outside"),
        ((2, 2, 1, 2, 3), "rank: 2 \\+ tensor-parallel rank 1"),
        ((0, 1, 0, 1, 2), "rank: 0"),
    ],
)
def test_engine_worker_rank_refuses_an_inconsistent_place(args, message):
    with pytest.raises(ValueError, match=message):
        engine_worker_rank(*args)


def _spec(**changes) -> WeightSyncSpec:
    spec = WeightSyncSpec("10.0.0.1", 29500, 1, 2, "gloo", [("w", [4, 4], "float32")], 64 * MiB,
                          rendezvous_key=KEY)
    return dataclasses.replace(spec, **changes)


def test_spec_built_positionally_as_the_trainer_does_is_tp_1():
    spec = WeightSyncSpec("10.0.0.1", 29500, 1, 2, "gloo", [("w", [4, 4], "float32")], 64 * MiB,
                          1, "", KEY)
    assert spec.tensor_parallel_size == 1 and spec.trainer_device_uuid == ""
    spec.check(1, 2, "10.0.0.1")
    assert KEY not in repr(spec)  # a secret stays out of logs


def test_spec_of_a_tp_engine_passes_check_at_its_planned_place():
    plan = RankPlan.for_engines([2, 2])
    spec = _spec(rank=plan.first_rank(1), world_size=plan.world_size, tensor_parallel_size=2)
    spec.check(3, 5, "10.0.0.1", expected_tensor_parallel_size=2)


@pytest.mark.parametrize(
    ("changes", "check_args", "field"),
    [
        (dict(tensor_parallel_size=0), (1, 2), "tensor_parallel_size: 0 is out of range"),
        (dict(tensor_parallel_size=65, world_size=70), (1, 70), "tensor_parallel_size: 65"),
        # The engine's last TP worker would be rank 2 in a group of ranks 0..1.
        (dict(tensor_parallel_size=2), (1, 2), "rank: 1 with tensor_parallel_size 2"),
        (dict(rank=0), (0, 2), "rank: 0 with tensor_parallel_size 1"),
        (dict(rank=3, world_size=4, tensor_parallel_size=2), (3, 4), "rank: 3 with"),
        (dict(rank=2, world_size=3), (1, 3), "rank: 2 is not this worker's rank"),
        (dict(world_size=3), (1, 2), "world_size: 3"),
        (dict(trainer_device_uuid="x" * 65), (1, 2), "trainer_device_uuid"),
        # No unkeyed join, and only a key as the trainer draws one.
        (dict(rendezvous_key=""), (1, 2), "rendezvous_key: must be 32 lowercase hex"),
        (dict(rendezvous_key=KEY.upper()), (1, 2), "rendezvous_key"),
        (dict(rendezvous_key=KEY[:-1]), (1, 2), "rendezvous_key"),
        (dict(rendezvous_key=KEY + "a"), (1, 2), "rendezvous_key"),
        (dict(rendezvous_key=KEY[:-1] + "\n"), (1, 2), "rendezvous_key"),
    ],
)
def test_spec_check_names_the_inconsistent_field(changes, check_args, field):
    with pytest.raises(ValueError, match=field):
        _spec(**changes).check(*check_args, "10.0.0.1")


def test_spec_check_refuses_a_tp_size_other_than_the_engines():
    spec = _spec(world_size=3, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 is not this engine's"):
        spec.check(1, 3, "10.0.0.1", expected_tensor_parallel_size=1)


@pytest.mark.parametrize(
    ("trainer", "engine"),
    [
        ("6f2c1e0a-0000-4000-8000-000000000001", "6f2c1e0a-0000-4000-8000-000000000001"),
        ("GPU-6F2C1E0A-0000-4000-8000-000000000001", "6f2c1e0a-0000-4000-8000-000000000001"),
    ],
)
def test_same_gpu_is_refused_with_what_to_do(trainer, engine):
    with pytest.raises(ValueError) as err:
        check_distinct_gpus(trainer, engine)
    message = str(err.value)
    assert message.startswith("trainer_device_uuid:")
    assert "different GPUs" in message and "gloo" in message and "CUDA IPC" in message


@pytest.mark.parametrize(
    ("trainer", "engine"),
    [
        ("6f2c1e0a-0000-4000-8000-000000000001", "6f2c1e0a-0000-4000-8000-000000000002"),
        ("", "6f2c1e0a-0000-4000-8000-000000000001"),
        ("", ""),
    ],
)
def test_distinct_or_unknown_gpus_pass(trainer, engine):
    check_distinct_gpus(trainer, engine)


def test_gloo_broadcast_reaches_every_tp_worker_at_its_planned_rank():
    """Engine 0 with two TP workers and engine 1 with one, each worker in its own
    thread with its own group, as each vLLM worker process builds one."""
    torch.manual_seed(0)
    named = [("w1", torch.randn(3, 5)), ("w2", torch.randn(7)), ("h", torch.randn(2, 2).half())]
    plan = RankPlan.for_engines([2, 1])
    port, key = free_port(), new_rendezvous_key()
    received: dict[int, dict[str, torch.Tensor]] = {}
    errors: list[BaseException] = []

    def tp_worker(first_rank: int, tp_size: int, tp_rank: int) -> None:
        try:
            rank = engine_worker_rank(first_rank, tp_size, tp_rank, tp_size, plan.world_size)
            group = make_group("127.0.0.1", port, rank, plan.world_size, "gloo", timeout_s=30,
                               rendezvous_key=key)
            got = receive_weights(group, specs_of(named), 64, torch.device("cpu"))
            received[rank] = {name: t.clone() for name, t in got}
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    threads = [
        threading.Thread(target=tp_worker, args=(plan.first_rank(e), len(ranks), t))
        for e, ranks in enumerate(plan.engine_ranks)
        for t in range(len(ranks))
    ]
    for thread in threads:
        thread.start()
    group = make_group("127.0.0.1", port, 0, plan.world_size, "gloo", timeout_s=30,
                       rendezvous_key=key)
    send_weights(group, named, bucket_bytes=64)
    for thread in threads:
        thread.join(30)
    assert not errors
    assert sorted(received) == [1, 2, 3]
    for tensors in received.values():
        for name, t in named:
            torch.testing.assert_close(tensors[name], t)


def test_worker_init_joins_at_the_engine_rank_without_a_tp_group():
    """In a process where vLLM has built no model-parallel groups, a TP-1 worker
    joins at the engine's rank, as every engine did before TP."""
    pytest.importorskip("vllm")
    named = [("w", torch.arange(6.0).reshape(2, 3))]
    tensors = [(s.name, list(s.shape), s.dtype) for s in specs_of(named)]
    port = free_port()
    received: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def engine_worker() -> None:
        try:
            worker = SimpleNamespace()
            assert worker_init_weight_sync(worker, "127.0.0.1", port, 1, 2, "gloo", tensors, 64,
                                           rendezvous_key=KEY)
            state = worker._reflow_wsync
            got = receive_weights(state["group"], state["specs"], state["bucket_bytes"],
                                  torch.device("cpu"))
            received.update((name, t.clone()) for name, t in got)
        except BaseException as err:  # noqa: BLE001 - reported by the main thread
            errors.append(err)

    thread = threading.Thread(target=engine_worker)
    thread.start()
    group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=30, rendezvous_key=KEY)
    send_weights(group, named, bucket_bytes=64)
    thread.join(30)
    assert not errors
    torch.testing.assert_close(received["w"], named[0][1])


def test_worker_init_refuses_a_tp_size_the_engine_does_not_run():
    pytest.importorskip("vllm")
    with pytest.raises(ValueError, match="tensor_parallel_size: 2 but this engine runs 1"):
        worker_init_weight_sync(SimpleNamespace(), "127.0.0.1", 1, 1, 3, "gloo",
                                [("w", [1], "float32")], 64, tensor_parallel_size=2,
                                rendezvous_key=KEY)
