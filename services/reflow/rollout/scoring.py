"""From a finished GRPO group to trajectories: rewards (through the reward pool,
off the worker's event loop), group-normalised advantages, and what a sample
without a reward becomes.

A sample whose reward failed (reflow.tasks.rewards: an exception, a timeout, a
non-finite value; or an environment's error) is **excluded from training**: it
is kept in its group, so groups stay whole in the buffer, but it gets an
all-zero loss mask and advantage 0, and the group's baseline is taken over its
scored members only. Reward 0 instead would teach the policy that whatever made
the scorer fail (often a long or odd response) is wrong, which it may not be;
exclusion teaches nothing from a sample nobody scored. The job fails only when
failures pass `task.max_reward_error_rate` over the last `task.reward_error_window`
samples (ErrorWindow), with the counts by reason in its status.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Callable

from reflow.core.types import Segment, Trajectory, group_advantages
from reflow.tasks.base import Prompt
from reflow.tasks.rewards import RewardResult

Scorer = Callable[[Prompt, str], RewardResult]


def score_inline(task) -> Scorer:
    """Score in the calling thread, with the pool's treatment of raising and
    non-finite rewards but no timeout: for engines and tests that run without a
    reward pool. The rollout service always scores through a RewardPool."""
    def score(prompt: Prompt, text: str) -> RewardResult:
        try:
            value = float(task.reward(prompt, text))
        except Exception as err:  # noqa: BLE001 - a failed reward is data
            return RewardResult(0.0, "exception", f"{type(err).__name__}: {err}"[:300])
        if not math.isfinite(value):
            return RewardResult(0.0, "non_finite", repr(value))
        return RewardResult(value)
    return score


async def score_texts(scorer: Scorer, prompt: Prompt, texts: list[str]) -> list[RewardResult]:
    """Every response's reward, computed off the event loop, concurrently."""
    return list(await asyncio.gather(*(asyncio.to_thread(scorer, prompt, t) for t in texts)))


def group_trajectories(group_id: str, prompt_ids: list[int], samples: list,
                       results: list[RewardResult],
                       loss_masks: list[list[int]] | None = None) -> list[Trajectory]:
    """The group's trajectories. `samples` carry response_ids, logprobs, segments
    and finish_reason (rollout.records.PartialSample or an episode's result);
    `loss_masks` default to all ones (every response token sampled by the policy)."""
    scored = [i for i, r in enumerate(results) if not r.error]
    advantages = [0.0] * len(samples)
    for i, a in zip(scored, group_advantages([results[i].value for i in scored])):
        advantages[i] = a
    now = time.time()
    out = []
    for i, (s, r) in enumerate(zip(samples, results)):
        mask = loss_masks[i] if loss_masks is not None else [1] * len(s.response_ids)
        if r.error:
            mask = [0] * len(s.response_ids)
        out.append(Trajectory(
            sample_id=f"{group_id}-{i}", group_id=group_id, prompt_ids=prompt_ids,
            response_ids=s.response_ids, logprobs=s.logprobs, loss_mask=mask,
            segments=[Segment(seg.policy_version, seg.num_tokens) for seg in s.segments],
            reward=r.value, advantage=advantages[i], finish_reason=s.finish_reason,
            created_at=now, reward_error=r.error))
    return out


class ErrorWindow:
    """Reward failures over the last `window` scored samples, by reason."""

    def __init__(self, max_rate: float, window: int) -> None:
        self.max_rate, self.window = max_rate, window
        self._recent: deque[str] = deque(maxlen=window)
        self.totals: Counter[str] = Counter()

    def add(self, results: list[RewardResult]) -> str:
        """Record a group's results; returns why the job must fail ("" if it need not)."""
        for r in results:
            self._recent.append(r.error)
            if r.error:
                self.totals[r.error] += 1
        failed = Counter(e for e in self._recent if e)
        num_failed = sum(failed.values())
        if len(self._recent) < self.window or num_failed <= self.max_rate * len(self._recent):
            return ""
        reasons = ", ".join(f"{reason} {n}" for reason, n in failed.most_common())
        return (f"reward errors in {num_failed} of the last {len(self._recent)} samples "
                f"({reasons}) exceed task.max_reward_error_rate {self.max_rate:g}")
