"""From a finished GRPO group to trajectories: rewards (through the reward pool,
off the worker's event loop), the job's advantage estimator
(`algorithm.advantage`), what a sample without a reward becomes, and DAPO's
treatment of over-long responses and of groups without signal
(`algorithm.overlong`, `algorithm.dynamic_sampling`; GroupScoring).

A sample whose reward failed (reflow.tasks.rewards.REWARD_ERRORS: an exception,
a timeout, a non-finite value, a crash, a resource limit, a broken protocol; or
an environment's error) is **excluded from training**: it is kept in its group,
so groups stay whole in the buffer, but it gets an all-zero loss mask and
advantage 0, and the group's baseline is taken over its scored members only.
Reward 0 instead would teach the policy that whatever made the scorer fail
(often a long or odd response) is wrong, which it may not be; exclusion
teaches nothing from a sample nobody scored. The job fails only when
failures pass `task.max_reward_error_rate` over the last `task.reward_error_window`
samples (ErrorWindow), with the counts by reason in its status.

Over-long responses (DAPO §3.4) stay in their group's baseline either way:
`mask` only takes a response cut at the length limit (finish_reason "length")
out of the loss, as a failed reward is; `penalty` adds the soft over-length
penalty to every scored response's reward by its length, before the
advantages, and the trajectory carries the penalised reward.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import Counter, deque
from collections.abc import Callable

from reflow.algorithms.advantages import (AdvantageEstimator, GroupNormalised, equal_rewards,
                                          load_estimator, overlong_penalty)
from reflow.core.algorithm_config import AlgorithmConfig
from reflow.core.types import Segment, Trajectory
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


class GroupScoring:
    """What a job's `algorithm` section does to a finished group: its advantage
    estimator, its treatment of over-long responses, and whether a group whose
    rewards are all equal is dropped (DAPO's dynamic sampling). Built once per
    worker; None: GRPO's advantages, nothing else (the spec's defaults)."""

    def __init__(self, algorithm: AlgorithmConfig | None = None) -> None:
        self.estimator: AdvantageEstimator = (load_estimator(algorithm.advantage_name)
                                              if algorithm is not None else GroupNormalised())
        self.dynamic_sampling = algorithm is not None and algorithm.dynamic_sampling
        self.overlong = algorithm.overlong if algorithm is not None else "keep"
        self.buffer_tokens = algorithm.overlong_buffer_tokens if algorithm is not None else 1
        self.penalty = algorithm.overlong_penalty if algorithm is not None else 0.0

    def rewards(self, samples: list, results: list[RewardResult],
                max_tokens: int) -> list[float]:
        """Each sample's reward as trained on: its score, plus the over-length
        penalty of its length under `max_tokens` with overlong=penalty (a sample
        without a reward keeps 0)."""
        if self.overlong != "penalty":
            return [r.value for r in results]
        return [r.value if r.error else
                r.value + overlong_penalty(len(s.response_ids), max_tokens,
                                           self.buffer_tokens, self.penalty)
                for s, r in zip(samples, results)]

    def masked(self, sample) -> bool:
        """Whether overlong=mask takes `sample` out of the loss: it was cut at the
        length limit, so its reward judges an unfinished answer (DAPO §3.4)."""
        return self.overlong == "mask" and sample.finish_reason == "length"

    def drops(self, trajectories: list[Trajectory]) -> bool:
        """With dynamic sampling, whether the group never reaches the buffer: its
        scored rewards are all equal, so every member's advantage is zero (DAPO
        §3.2). The worker ends it with a GROUP_FILTERED event instead, and the
        dispatcher spends its grant on a new prompt."""
        return self.dynamic_sampling and equal_rewards(
            [t.reward for t in trajectories if not t.reward_error])


def group_trajectories(group_id: str, prompt_ids: list[int], samples: list,
                       results: list[RewardResult],
                       loss_masks: list[list[int]] | None = None,
                       scoring: GroupScoring | None = None,
                       max_tokens: int = 0) -> list[Trajectory]:
    """The group's trajectories. `samples` carry response_ids, logprobs, segments
    and finish_reason (rollout.records.PartialSample or an episode's result);
    `loss_masks` default to all ones (every response token sampled by the policy);
    `scoring` is the job's algorithm (None: GRPO, nothing else); `max_tokens` the
    length limit the samples were generated under (L_max of the over-length
    penalty: the curriculum stage's max_tokens, or an episode's token budget)."""
    scoring = scoring or GroupScoring()
    rewards = scoring.rewards(samples, results, max_tokens)
    scored = [i for i, r in enumerate(results) if not r.error]
    advantages = [0.0] * len(samples)
    for i, a in zip(scored, scoring.estimator.compute([rewards[i] for i in scored])):
        advantages[i] = a
    now = time.time()
    out = []
    for i, (s, r) in enumerate(zip(samples, results)):
        mask = loss_masks[i] if loss_masks is not None else [1] * len(s.response_ids)
        if r.error or scoring.masked(s):
            mask = [0] * len(s.response_ids)
        out.append(Trajectory(
            sample_id=f"{group_id}-{i}", group_id=group_id, prompt_ids=prompt_ids,
            response_ids=s.response_ids, logprobs=s.logprobs, loss_mask=mask,
            segments=[Segment(seg.policy_version, seg.num_tokens) for seg in s.segments],
            reward=rewards[i], advantage=advantages[i], finish_reason=s.finish_reason,
            created_at=now, reward_error=r.error, min_tokens=getattr(s, "min_tokens", 0)))
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
