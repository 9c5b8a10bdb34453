"""Weight synchronisation over torch.distributed (paper §4.1 step 4).

The trainer (rank 0) broadcasts its parameters to every rollout engine in
flat buckets; each engine slices the buckets back into named tensors and
reloads them in place. The same code runs on gloo (CPU) and NCCL (GPU); the
backend is chosen by device.

Each side builds a private process group from its own TCPStore instead of
the global default group, so the trainer's own data-parallel group (and
vLLM's) are untouched. Tensors never travel through RPC arguments: only the
metadata (names, shapes, dtypes) does, once, when the group is built.

Every group's keys on its store sit under a secret the side that creates the
store draws for each build (`new_rendezvous_key`) and hands to the other ranks
in the authenticated RPC that tells them where to meet (InitWeightSync,
JoinGroup). A TCPStore has no authentication and cannot list its keys, so a
party that reaches the store's port without the secret waits for peers that
never come, and cannot read or overwrite the group's addresses (or NCCL's
unique id). What it can still do, and what closes it, is in docs/operations/security.md
("Weight-sync rendezvous").

The worker-side functions run inside the vLLM worker process, called by name
through `collective_rpc` (rollout/vllm_worker.py mixes them into vLLM's worker);
they take the worker as `self` and keep their state on it.

Ranks: the trainer is 0, then every tensor-parallel worker of engine 0, then
engine 1's, and so on (`RankPlan`). Each TP worker receives the whole model and
its checkpoint loader keeps its own shard, so the trainer needs no knowledge of
how an engine is sharded, only how many workers it has.

Not handled: a trainer and an engine worker on the same GPU. NCCL cannot connect
two ranks on one device, so that join is refused with a clear error
(`check_distinct_gpus`). Supporting it takes CUDA IPC instead of a broadcast (the
trainer exports handles to its parameter storage and the engine maps them), which
this module does not implement. Pipeline-parallel engines are not handled either.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import re
import secrets
import time
from collections import Counter
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 64 * 1024 * 1024
_STORE_PREFIX = "reflow-wsync"
# What new_rendezvous_key draws: 16 random bytes as lowercase hex.
RENDEZVOUS_KEY_BYTES = 16
_RENDEZVOUS_KEY = re.compile(f"[0-9a-f]{{{2 * RENDEZVOUS_KEY_BYTES}}}")


def new_rendezvous_key() -> str:
    """A fresh secret for one group build (128 bits, unguessable on the store)."""
    return secrets.token_hex(RENDEZVOUS_KEY_BYTES)


def check_rendezvous_key(key: str) -> str:
    """`key` if it is what new_rendezvous_key draws; ValueError naming the field
    otherwise (an empty key included: there is no unkeyed rendezvous). The key
    is a secret and never appears in the message."""
    if not isinstance(key, str) or not _RENDEZVOUS_KEY.fullmatch(key):
        got = f"{len(key)} characters" if isinstance(key, str) else type(key).__name__
        raise ValueError(f"rendezvous_key: must be {2 * RENDEZVOUS_KEY_BYTES} lowercase hex "
                         f"characters, the secret the trainer draws for the group; got {got}")
    return key


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * self.torch_dtype.itemsize


def specs_of(named: list[tuple[str, torch.Tensor]]) -> list[TensorSpec]:
    return [TensorSpec(n, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for n, t in named]


def plan_buckets(specs: list[TensorSpec], bucket_bytes: int) -> list[list[TensorSpec]]:
    """Split tensors into buckets of one dtype and at most `bucket_bytes` each
    (a tensor larger than a bucket gets a bucket of its own). Both sides call
    this with the same inputs, so they agree on the layout without talking."""
    if bucket_bytes <= 0:
        raise ValueError("bucket_bytes must be positive")
    buckets: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if current and (size + spec.nbytes > bucket_bytes or spec.dtype != current[0].dtype):
            buckets.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class RankPlan:
    """Every rank of one job's weight-sync group: the trainer is rank 0, then the
    tensor-parallel workers of engine 0, of engine 1, and so on."""

    # engine_ranks[i][t]: the rank of engine i's TP worker t.
    engine_ranks: tuple[tuple[int, ...], ...]

    @classmethod
    def for_engines(cls, engine_tp_sizes: list[int]) -> RankPlan:
        """The plan for engines with these tensor-parallel sizes, in engine order."""
        engine_ranks = []
        next_rank = 1
        for i, size in enumerate(engine_tp_sizes):
            if size < 1:
                raise ValueError(f"engine_tp_sizes[{i}]: {size}; a tensor-parallel size is >= 1")
            engine_ranks.append(tuple(range(next_rank, next_rank + size)))
            next_rank += size
        return cls(tuple(engine_ranks))

    @property
    def world_size(self) -> int:
        return 1 + sum(len(ranks) for ranks in self.engine_ranks)

    def first_rank(self, engine: int) -> int:
        """The rank an engine is told (WeightSyncSpec.rank); its TP worker t adds t."""
        return self.engine_ranks[engine][0]


def engine_worker_rank(
    first_rank: int, tensor_parallel_size: int, tp_rank: int, tp_world_size: int, world_size: int
) -> int:
    """The rank of one engine's TP worker `tp_rank`, checked against the TP group
    the engine really runs (`tp_world_size`) and the group's size."""
    if tp_world_size != tensor_parallel_size:
        raise ValueError(f"tensor_parallel_size: {tensor_parallel_size} but this engine runs "
                         f"{tp_world_size} tensor-parallel workers")
    if not 0 <= tp_rank < tensor_parallel_size:
        raise ValueError(f"tensor-parallel rank {tp_rank} is outside [0, {tensor_parallel_size})")
    rank = first_rank + tp_rank
    if not 1 <= rank < world_size:
        raise ValueError(f"rank: {first_rank} + tensor-parallel rank {tp_rank} is outside the "
                         f"engine ranks [1, {world_size}) of the weight-sync group")
    return rank


def cuda_device_uuid(device: torch.device | int) -> str:
    """The device's UUID as `torch` prints it (no "GPU-" prefix)."""
    return str(torch.cuda.get_device_properties(device).uuid)


def check_distinct_gpus(trainer_device_uuid: str, engine_device_uuid: str) -> None:
    """Refuse an NCCL join between two ranks on one GPU, which NCCL cannot connect
    (it fails or hangs deep inside the first broadcast). An empty UUID means
    unknown and passes."""
    trainer = trainer_device_uuid.lower().removeprefix("gpu-")
    engine = engine_device_uuid.lower().removeprefix("gpu-")
    if trainer and trainer == engine:
        raise ValueError(
            f"trainer_device_uuid: the trainer and this rollout engine are both on GPU "
            f"{trainer_device_uuid}, and NCCL weight sync needs them on different GPUs. "
            "Place the trainer and the engine on different GPUs, or run the trainer on "
            "CPU so that weight sync uses the gloo backend. (Sharing one GPU would take "
            "CUDA IPC weight transfer, which ReFlow does not implement.)"
        )


@dataclass
class SyncGroup:
    """A private process group and the store it was built on (kept alive with it)."""

    group: dist.ProcessGroup
    store: dist.Store

    def abort(self) -> None:
        """Close the group's connections now, so that every peer still blocked in one
        of its collectives (a survivor receiving a broadcast its sender gave up on)
        fails at once instead of after the group's timeout. Gloo closes its pairs
        only when the group is destroyed (its abort() leaves a peer's receive
        waiting: measured), so the group is released here and collected; a
        reference left elsewhere (a traceback's frame) keeps the SyncGroup, not the
        process group. Unusable afterwards."""
        group, self.group = self.group, None
        self.store = None
        if group is None:
            return
        try:
            group.abort()  # NCCL: aborts the communicator
        except Exception as err:  # noqa: BLE001 - gloo's may refuse; destroying it is what counts
            logger.debug("weight-sync group abort: %s: %s", type(err).__name__, err)
        del group
        gc.collect()


def make_group(
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    backend: str,
    timeout_s: float = 600.0,
    *,
    rendezvous_key: str,
) -> SyncGroup:
    """Rendezvous on a private TCPStore and build the group. `timeout_s` bounds the
    rendezvous and every collective of the group: a peer that died or hangs
    becomes an error after that long instead of a wait forever (gloo raises in the
    waiting call; NCCL's watchdog aborts the communicator and, by default, the
    process). `rendezvous_key`: the group's secret (new_rendezvous_key, drawn by
    rank 0); every rank must give the same one, and a rank with another never
    meets the group (its rendezvous times out)."""
    check_rendezvous_key(rendezvous_key)
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"weight sync backend must be gloo or nccl, got {backend!r}")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    prefixed = keyed_store(store, rendezvous_key)
    with key_redacted(rendezvous_key):
        if backend == "gloo":
            group = dist.ProcessGroupGloo(prefixed, rank, world_size, timeout)
        else:
            options = dist.ProcessGroupNCCL.Options()
            options._timeout = timeout  # without options NCCL keeps its own 10-minute default
            group = dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    return SyncGroup(group, store)


def keyed_store(store: dist.Store, rendezvous_key: str,
                prefix: str = _STORE_PREFIX) -> dist.PrefixStore:
    """`store` seen under `prefix`/`rendezvous_key`: the group's keys, which only a
    holder of the key can name."""
    return dist.PrefixStore(f"{prefix}/{check_rendezvous_key(rendezvous_key)}", store)


@contextlib.contextmanager
def key_redacted(rendezvous_key: str):
    """Around a group's rendezvous: an error that names the group's store keys (a
    timeout's "wait timeout after 3000ms, keys: /reflow-wsync/<key>/0/0") is raised
    again, of its type, with the key replaced, so that the secret never reaches a
    log or a GetStatus error."""
    try:
        yield
    except Exception as err:
        message = str(err)
        if rendezvous_key not in message:
            raise
        message = message.replace(rendezvous_key, "<rendezvous_key>")
        try:
            redacted = type(err)(message)
        except Exception:  # noqa: BLE001 - a type that takes other arguments
            redacted = RuntimeError(f"{type(err).__name__}: {message}")
        raise redacted from None


def broadcast_bucket(group: SyncGroup, tensor: torch.Tensor) -> None:
    """Rank 0's `tensor` to every rank of `group` (one bucket of weights)."""
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    group.group.broadcast([tensor], opts).wait()


def send_weights(
    group: SyncGroup,
    named: list[tuple[str, torch.Tensor]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    device: torch.device | None = None,
) -> int:
    """Rank 0: broadcast `named` tensors bucket by bucket. Returns bytes sent."""
    by_name = dict(named)
    sent = 0
    for bucket in plan_buckets(specs_of(named), bucket_bytes):
        flat = torch.cat([by_name[s.name].detach().reshape(-1) for s in bucket])
        if device is not None:
            flat = flat.to(device)
        broadcast_bucket(group, flat)
        sent += flat.numel() * flat.element_size()
    return sent


def receive_weights(
    group: SyncGroup,
    specs: list[TensorSpec],
    bucket_bytes: int,
    device: torch.device,
):
    """Rank > 0: receive every bucket and yield (name, tensor) views into it."""
    for bucket in plan_buckets(specs, bucket_bytes):
        flat = torch.empty(sum(s.numel for s in bucket), dtype=bucket[0].torch_dtype, device=device)
        broadcast_bucket(group, flat)
        offset = 0
        for spec in bucket:
            yield spec.name, flat[offset : offset + spec.numel].view(spec.shape)
            offset += spec.numel


# --- functions run inside the vLLM worker (rollout/vllm_worker.py) ------------


def worker_init_weight_sync(
    self,
    master_address: str,
    master_port: int,
    first_rank: int,
    world_size: int,
    backend: str,
    specs: list[tuple[str, list[int], str]],
    bucket_bytes: int,
    tensor_parallel_size: int = 1,
    trainer_device_uuid: str = "",
    rendezvous_key: str = "",
    lora: dict | None = None,
) -> bool:
    """Join the weight-sync group as rank `first_rank` + this worker's TP rank.
    `rendezvous_key`: the group's secret; an empty one is refused (make_group).
    `lora`: a LoRA job's adapter config (PEFT fields): the broadcasts carry its
    adapter tensors, loaded into the engine's LoRA slot (adapter_sync.py)."""
    tp_rank, tp_world_size = _tensor_parallel_position()
    rank = engine_worker_rank(first_rank, tensor_parallel_size, tp_rank, tp_world_size, world_size)
    if backend == "nccl":
        check_distinct_gpus(trainer_device_uuid, cuda_device_uuid(torch.cuda.current_device()))
    self._reflow_wsync = {
        "group": make_group(master_address, master_port, rank, world_size, backend,
                            rendezvous_key=rendezvous_key),
        "specs": [TensorSpec(n, tuple(s), d) for n, s, d in specs],
        "bucket_bytes": bucket_bytes,
        "lora": lora,
    }
    return True


def _tensor_parallel_position() -> tuple[int, int]:
    """(TP rank, TP size) of this vLLM worker; (0, 1) where vLLM has built no
    model-parallel groups (an engine run in-process without them is unsharded)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0, 1
    # Workers of different pipeline stages share TP ranks, so they would collide.
    if parallel_state.get_pp_group().world_size > 1:
        raise ValueError("weight sync does not support pipeline-parallel engines; "
                         "use tensor parallelism only")
    return (parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_world_size())


def worker_receive_weights(self) -> float:
    """Receive one broadcast and reload the model in place; returns seconds taken."""
    state = getattr(self, "_reflow_wsync", None)
    if state is None:
        raise RuntimeError("weight sync used before worker_init_weight_sync")
    if state["lora"] is not None:
        from reflow.adapter_sync import worker_receive_adapter

        return worker_receive_adapter(self, state)
    start = time.perf_counter()
    model = self.model_runner.get_model()
    device = getattr(self.model_runner, "device", None) or next(model.parameters()).device
    if "not_loaded" not in state:
        state["not_loaded"] = layers_without_weights(model, {s.name for s in state["specs"]})
    failed: list[BaseException] = []

    def received():
        # A broadcast cut off part-way (its sender died, or gave up on another
        # engine) ends the iterator instead of raising into the reload: vLLM's
        # layerwise reload moves each layer to the meta device until its tensors
        # arrive and restores it only when the load finishes, so an exception out
        # of the iterator would leave layers on meta and every later reload broken.
        # The layers the cut-off version did not reach keep their weights; the
        # engine stays paused (rollout/weights.py) until a whole version arrives.
        try:
            yield from receive_weights(state["group"], state["specs"], state["bucket_bytes"],
                                       device)
        except Exception as err:  # noqa: BLE001 - raised after the reload finishes
            failed.append(err)

    # reload_weights consumes the iterator, so buckets are received as it loads.
    with expected_reload_warnings_dropped(state["not_loaded"]):
        self.model_runner.reload_weights(weights_iterator=received())
    if failed:
        raise failed[0]
    _refresh_tied_lm_head(model, state["specs"])
    return time.perf_counter() - start


# vLLM's in-place reload warns "<layer class>: Failed to load weights" for every layer
# that received nothing and keeps that layer's tensors as they were. Two kinds of layer
# never receive anything, on every weight update, by design: an LM head tied to the
# embedding (the checkpoint has no lm_head tensor; the embedding's load updates it), and
# a layer holding only derived buffers (the rotary embedding's cos/sin cache). On the
# quickstart's model those were the only two, at every update (none at engine start,
# whose first load processes such layers quietly); any other layer's warning still shows.
_RELOAD_LOGGER = "vllm.model_executor.model_loader.reload.layerwise"
_NOT_LOADED_MSG = "%s: Failed to load weights"


def layers_without_weights(model: torch.nn.Module, sent: set[str]) -> Counter[str]:
    """Class name -> how many of `model`'s layers an in-place reload of the tensors
    named `sent` leaves unloaded by design: each of the layer's own tensors is a buffer
    or a parameter shared with another layer (tied), and none is named in `sent`."""
    holders = Counter(id(p) for m in model.modules() for p in m._parameters.values()
                      if p is not None)
    expected: Counter[str] = Counter()
    for prefix, layer in model.named_modules():
        own = [(name, holders[id(t)] > 1) for name, t in layer._parameters.items() if t is not None]
        own += [(name, True) for name, t in layer._buffers.items() if t is not None]
        if own and all(by_design and f"{prefix}.{name}".lstrip(".") not in sent
                       for name, by_design in own):
            expected[type(layer).__name__] += 1
    return expected


class _DropExpected(logging.Filter):
    """Drops vLLM's not-loaded warning for at most `expected[class]` layers of each
    class: the record names the layer's class only, so the count keeps a failure of
    one more layer of that class visible."""

    def __init__(self, expected: Counter[str]) -> None:
        super().__init__()
        self.remaining = Counter(expected)

    def filter(self, record: logging.LogRecord) -> bool:
        if record.msg == _NOT_LOADED_MSG and record.args:
            layer = str(record.args[0])
            if self.remaining[layer] > 0:
                self.remaining[layer] -= 1
                return False
        return True


@contextlib.contextmanager
def expected_reload_warnings_dropped(expected: Counter[str]):
    """Around one in-place reload: vLLM's warning for the layers in `expected`
    (`layers_without_weights`) is dropped; every other record passes."""
    reload_logger = logging.getLogger(_RELOAD_LOGGER)
    drop = _DropExpected(expected)
    reload_logger.addFilter(drop)
    try:
        yield
    finally:
        reload_logger.removeFilter(drop)


def worker_release_kv_cache(self) -> dict[str, int]:
    """Hand the pages of this worker's KV cache back to the OS (madvise
    MADV_DONTNEED on private memory): they read as zeros when touched again, which
    attention never reads before writing. CPU only; on GPU vLLM's sleep mode is the
    mechanism, not this. Returns bytes released and this process's RSS around it."""
    import ctypes
    import mmap

    import psutil

    rss_before = psutil.Process().memory_info().rss
    if next(self.model_runner.get_model().parameters()).device.type != "cpu":
        return {"released": 0, "rss_before": rss_before, "rss_after": rss_before}
    libc = ctypes.CDLL(None, use_errno=True)
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    page, released, seen = mmap.PAGESIZE, 0, set()
    for tensor in _flat_tensors(self.model_runner.kv_caches):
        storage = tensor.untyped_storage()
        start, size = storage.data_ptr(), storage.nbytes()
        if start in seen:
            continue
        seen.add(start)
        # Whole pages inside the storage only: a neighbour may share the edges.
        first, last = -(-start // page) * page, (start + size) // page * page
        if last > first and libc.madvise(first, last - first, 4) == 0:  # MADV_DONTNEED
            released += last - first
    return {"released": released, "rss_before": rss_before,
            "rss_after": psutil.Process().memory_info().rss}


def _flat_tensors(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _flat_tensors(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _flat_tensors(v)]
    return []


def _refresh_tied_lm_head(model, specs: list[TensorSpec]) -> None:
    """With tied embeddings the checkpoint has no lm_head weight, so the in-place
    reload never re-processes the lm_head layer. On CPU that layer keeps a GEMM
    handle packed from the *old* embedding at load time; re-run its post-load
    step so logits use the new weights. (On GPU the step is a no-op.)"""
    lm_head = getattr(model, "lm_head", None)
    method = getattr(lm_head, "quant_method", None)
    if method is None or any(s.name == "lm_head.weight" for s in specs):
        return
    method.process_weights_after_loading(lm_head)
