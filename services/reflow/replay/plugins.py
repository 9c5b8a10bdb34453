"""Pluggable data selection for the replay buffer (paper §4.2).

A `Sampler` decides which groups a batch may take from a pool, and in what
order of preference; a `ReplayFilter` decides, after training, whether each
sample goes back into the replay pool or is dropped. Both are chosen by
registered name in the JobSpec (`replay.sampler`, `replay.replay_filter`; see
`reflow.core.plugins` for the registry and how an operator adds one), with
keyword arguments from `replay.sampler_args` / `replay.filter_args`, checked
against the plug-in's own `Args` model first.

Neither knows about Redis or leases: they see plain metadata.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field, model_validator

from reflow.core import plugins


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

    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

        low: float = Field(default=0.0, ge=-1e6, le=1e6, description="Exclusive lower bound.")
        high: float = Field(default=1.0, ge=-1e6, le=1e6, description="Exclusive upper bound.")

        @model_validator(mode="after")
        def _ordered(self):
            if not self.low < self.high:
                raise ValueError(f"low ({self.low}) must be below high ({self.high})")
            return self

    def __init__(self, low: float = 0.0, high: float = 1.0) -> None:
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

    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

        max_uses: int = Field(default=2, ge=1, le=1_000_000,
                              description="Trainings after which a sample is dropped.")

    def __init__(self, max_uses: int = 2) -> None:
        self.max_uses = int(max_uses)

    def keep(self, sample: SampleInfo) -> bool:
        return sample.uses < self.max_uses


class NonZeroAdvantage:
    """Drop samples whose advantage is zero: they add no gradient when replayed."""

    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

        eps: float = Field(default=1e-6, ge=0.0, le=1e6,
                           description="|advantage| at or below this counts as zero.")

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps

    def keep(self, sample: SampleInfo) -> bool:
        return abs(sample.advantage) > self.eps


def load_sampler(name: str, args: dict[str, Any] | None = None) -> Sampler:
    """The registered sampler `name`, built with validated `args` (see core.plugins)."""
    return plugins.build("sampler", name, args, field="replay.sampler",
                         args_field="replay.sampler_args")


def load_filter(name: str, args: dict[str, Any] | None = None) -> ReplayFilter:
    """The registered replay filter `name`, built with validated `args`."""
    return plugins.build("replay_filter", name, args, field="replay.replay_filter",
                         args_field="replay.filter_args")
