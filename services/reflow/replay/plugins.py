"""Pluggable data selection for the replay buffer (paper §4.2).

A `Sampler` decides which groups a batch may take from a pool, and in what
order of preference; a `ReplayFilter` decides, after training, whether each
sample goes back into the replay pool or is dropped. Both are chosen by name
in the JobSpec (`replay.sampler`, `replay.replay_filter`) or given as an
import path `package.module:Class`, with keyword arguments from
`replay.sampler_args` / `replay.filter_args`.

Neither knows about Redis or leases: they see plain metadata.
"""

from __future__ import annotations

import importlib
import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class GroupInfo:
    """What a sampler sees of a candidate GRPO group."""

    group_id: str
    size: int
    reward_mean: float
    oldest_version: int
    uses: int
    num_tokens: int
    created_at: float


@dataclass(frozen=True)
class SampleInfo:
    """What a replay filter sees of a sample that has just been trained on."""

    sample_id: str
    group_id: str
    reward: float
    advantage: float
    # Times trained, this step included.
    uses: int
    num_tokens: int
    oldest_version: int
    stats: dict[str, float] = field(default_factory=dict)


@runtime_checkable
class Sampler(Protocol):
    def rank(self, candidates: list[GroupInfo], rng: random.Random) -> list[GroupInfo]:
        """Eligible candidates, most preferred first. The composer takes a prefix."""
        ...


@runtime_checkable
class ReplayFilter(Protocol):
    def keep(self, sample: SampleInfo) -> bool:
        """True: the sample returns to the replay pool; False: it is dropped."""
        ...


class UniformSampler:
    """Every candidate equally likely (the paper's default, §4.2)."""

    def rank(self, candidates: list[GroupInfo], rng: random.Random) -> list[GroupInfo]:
        ranked = list(candidates)
        rng.shuffle(ranked)
        return ranked


class FifoSampler:
    """Oldest policy version first, then oldest arrival: the order a synchronous or
    one-step-off trainer consumes its batches in."""

    def rank(self, candidates: list[GroupInfo], rng: random.Random) -> list[GroupInfo]:
        return sorted(candidates, key=lambda c: (c.oldest_version, c.created_at))


class MediumRewardSampler:
    """Only groups whose mean reward lies strictly between `low` and `high`:
    neither solved by every sample nor by none (§4.2, after DAPO). Such groups
    also carry non-zero GRPO advantages."""

    def __init__(self, low: float = 0.0, high: float = 1.0) -> None:
        if not low < high:
            raise ValueError(f"replay.sampler_args: low ({low}) must be below high ({high})")
        self.low, self.high = low, high

    def rank(self, candidates: list[GroupInfo], rng: random.Random) -> list[GroupInfo]:
        eligible = [c for c in candidates if self.low < c.reward_mean < self.high]
        rng.shuffle(eligible)
        return eligible


class AcceptAll:
    """Every trained sample is kept for replay (the paper's default)."""

    def keep(self, sample: SampleInfo) -> bool:
        return True


class MaxUseCount:
    """Keep a sample until it has been trained on `max_uses` times."""

    def __init__(self, max_uses: int = 2) -> None:
        if max_uses < 1:
            raise ValueError(f"replay.filter_args.max_uses must be >= 1, got {max_uses}")
        self.max_uses = int(max_uses)

    def keep(self, sample: SampleInfo) -> bool:
        return sample.uses < self.max_uses


class NonZeroAdvantage:
    """Drop samples whose advantage is zero: they add no gradient when replayed."""

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps

    def keep(self, sample: SampleInfo) -> bool:
        return abs(sample.advantage) > self.eps


SAMPLERS: dict[str, type] = {
    "uniform": UniformSampler,
    "fifo": FifoSampler,
    "medium_reward": MediumRewardSampler,
}
FILTERS: dict[str, type] = {
    "accept_all": AcceptAll,
    "max_use_count": MaxUseCount,
    "non_zero_advantage": NonZeroAdvantage,
}


def _resolve(name: str, registry: dict[str, type], field_name: str) -> type:
    if name in registry:
        return registry[name]
    if ":" not in name:
        raise ValueError(
            f"{field_name}: unknown plug-in {name!r}; built-ins are {', '.join(sorted(registry))}, "
            "or give an import path package.module:Class"
        )
    module_name, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{field_name}: cannot import {name!r}: {err}") from None


def _load(name: str, args: dict[str, Any] | None, registry: dict[str, type], field_name: str,
          protocol: type, method: str):
    cls = _resolve(name, registry, f"replay.{field_name}")
    args_field = "sampler_args" if field_name == "sampler" else "filter_args"
    try:
        plugin = cls(**(args or {}))
    except TypeError as err:
        raise ValueError(f"replay.{args_field}: {err}") from None
    if not isinstance(plugin, protocol):
        raise ValueError(f"replay.{field_name}: {name!r} has no {method} method")
    return plugin


def load_sampler(name: str, args: dict[str, Any] | None = None) -> Sampler:
    return _load(name, args, SAMPLERS, "sampler", Sampler, "rank(candidates, rng)")


def load_filter(name: str, args: dict[str, Any] | None = None) -> ReplayFilter:
    return _load(name, args, FILTERS, "replay_filter", ReplayFilter, "keep(sample)")
