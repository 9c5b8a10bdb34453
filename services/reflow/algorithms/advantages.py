"""Advantage estimators (the registered `advantage` plug-ins), and the two
things DAPO does to a finished group's rewards around them: the soft
over-length penalty added before the advantages, and the dynamic-sampling
test that drops a group whose rewards carry no advantage.

An estimator turns one GRPO group's rewards, its scored members only, into one
advantage per member (paper §4.1 step 2: the group is scored and normalised
when its last sample ends, and a replayed group keeps these advantages). It is
plain Python on a list of floats: the rollout worker and the simulator call it
where a group is scored, and neither imports torch for it. The job spec names
one (`algorithm.advantage`, or the loss's pairing); core/plugins.py resolves
the name, never a module path.

This module knows nothing of samples, masks or buffers: rollout/scoring.py
applies these to a group's trajectories.
"""

from __future__ import annotations

import math
from typing import Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

from reflow.core import plugins
from reflow.core.types import group_advantages

# Rewards closer than this count as equal for dynamic sampling.
EQUAL_REWARD_TOL = 1e-9


@runtime_checkable
class AdvantageEstimator(Protocol):
    def compute(self, rewards: list[float]) -> list[float]:
        """One advantage per reward, in order; [] for []."""
        ...


class _EpsArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")

    eps: float = Field(default=1e-6, gt=0.0, le=1.0,
                       description="Added to the std; a group whose std is below it gets zeros.")


class GroupNormalised:
    """GRPO (DeepSeekMath §4.1.2): reward minus the group mean, over the group's
    population std (÷ n) plus eps; a group whose std is below eps carries no
    signal and gets zeros. The formula is core.types.group_advantages, kept
    there so that nothing below reflow.algorithms loses it."""

    Args = _EpsArgs

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps

    def compute(self, rewards: list[float]) -> list[float]:
        return group_advantages(list(rewards), self.eps)


class GroupNormalisedSampleStd:
    """GRPO over the sample std (÷ n - 1), as TRL computes it with torch.std. A
    group of one has no sample std and gets zero; otherwise as `grpo`."""

    Args = _EpsArgs

    def __init__(self, eps: float = 1e-6) -> None:
        self.eps = eps

    def compute(self, rewards: list[float]) -> list[float]:
        n = len(rewards)
        if n < 2:
            return [0.0] * n
        mean = sum(rewards) / n
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (n - 1))
        if std < self.eps:
            return [0.0] * n
        return [(r - mean) / (std + self.eps) for r in rewards]


class MeanCentered:
    """Dr.GRPO (Liu et al. 2025, §3.2): reward minus the group mean, without the
    std division, which weights groups by how hard their prompt was."""

    def compute(self, rewards: list[float]) -> list[float]:
        if not rewards:
            return []
        mean = sum(rewards) / len(rewards)
        return [r - mean for r in rewards]


class LeaveOneOut:
    """RLOO (Ahmadian et al. 2024): reward minus the mean of the other members'
    rewards, a baseline independent of the sample it scores. A group of one has
    no other member and gets zero."""

    def compute(self, rewards: list[float]) -> list[float]:
        n = len(rewards)
        if n < 2:
            return [0.0] * n
        total = sum(rewards)
        return [r - (total - r) / (n - 1) for r in rewards]


def load_estimator(name: str) -> AdvantageEstimator:
    """The registered estimator `name` (core.plugins; the spec's field is
    `algorithm.advantage`), built with its defaults: the spec passes no arguments."""
    return plugins.build("advantage", name, None, field="algorithm.advantage",
                         args_field="algorithm.advantage_args")


def equal_rewards(rewards: list[float], tol: float = EQUAL_REWARD_TOL) -> bool:
    """DAPO's dynamic-sampling test (Yu et al. 2025, §3.2): True when a group's
    scored rewards are all equal (within `tol`), so every estimator gives it zero
    advantage and it adds nothing to the gradient. Fewer than two scored members
    count as equal: no comparison, no signal."""
    return len(rewards) < 2 or max(rewards) - min(rewards) <= tol


def overlong_penalty(length: int, max_tokens: int, buffer_tokens: int, penalty: float) -> float:
    """DAPO's soft over-length punishment (§3.4, eq. 13), added to a response's
    reward: 0 up to `max_tokens - buffer_tokens` (L_max - L_cache), then falling
    linearly to -`penalty` at `max_tokens`, and -`penalty` past it. It goes by
    length, not by how the response ended, so the policy learns to finish
    before the limit rather than only to avoid being cut."""
    if max_tokens < 1 or buffer_tokens < 1:
        raise ValueError(f"overlong penalty: max_tokens ({max_tokens}) and buffer_tokens "
                         f"({buffer_tokens}) must be >= 1")
    start = max_tokens - buffer_tokens
    if length <= start:
        return 0.0
    return max(-penalty, (start - length) / buffer_tokens * penalty)
