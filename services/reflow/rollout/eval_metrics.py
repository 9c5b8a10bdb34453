"""Held-out metrics from k samples per prompt: pass@k (the unbiased estimator
of Chen et al. 2021, "Evaluating Large Language Models Trained on Code", §2.1),
avg@k and maj@k (majority vote over the samples' final answers).

Pure arithmetic on per-prompt counts: it knows nothing of engines, tasks or
transports. The rollout worker counts (rollout/evaluation.py), the trainer
turns the counts into a metrics record (trainer/evaluation.py).

What counts as correct is the caller's: a sample whose reward reaches
`eval.correct_threshold`. A sample whose reward failed (reward_error) was never
verified, so it counts as an incorrect attempt in pass@k, casts no vote in
maj@k, and is left out of avg@k (it has no reward to average).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class PromptOutcome:
    """One held-out prompt's k samples, counted."""

    num_scored: int  # samples with a reward
    num_correct: int  # of those, rewards >= the correctness threshold
    reward_sum: float  # over the scored samples
    num_errors: int  # samples without a reward (reward_error)
    # Whether the majority-voted answer's sample is correct; False where no
    # sample gave an answer (no vote: the prompt counts as wrong).
    majority_correct: bool = False

    @property
    def num_samples(self) -> int:
        return self.num_scored + self.num_errors


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """The chance that at least one of k samples, drawn without replacement
    from `num_samples` of which `num_correct` are correct, is correct:
    1 - C(n-c, k) / C(n, k), as the product prod_{i=n-c+1}^{n} (1 - k/i),
    which neither overflows nor loses precision the way the binomials do."""
    if not 0 <= num_correct <= num_samples:
        raise ValueError(f"num_correct: {num_correct}; need 0 to num_samples ({num_samples})")
    if not 1 <= k <= num_samples:
        raise ValueError(f"k: {k}; need 1 to num_samples ({num_samples})")
    if num_samples - num_correct < k:
        return 1.0  # every draw of k holds a correct sample
    miss = 1.0
    for i in range(num_samples - num_correct + 1, num_samples + 1):
        miss *= 1.0 - k / i
    return 1.0 - miss


def majority_index(answers: Sequence[str | None]) -> int | None:
    """The index of the sample whose answer wins the vote, or None if no sample
    has an answer. A tie goes to the answer given first (lowest sample index):
    the samples' seeds fix their order, so the rule is reproducible and uses
    nothing the vote should not see (not the rewards)."""
    counts: dict[str, int] = {}
    first: dict[str, int] = {}
    for i, answer in enumerate(answers):
        if answer is None:
            continue
        counts[answer] = counts.get(answer, 0) + 1
        first.setdefault(answer, i)
    if not counts:
        return None
    winner = max(counts, key=lambda a: (counts[a], -first[a]))
    return first[winner]


def summarize(outcomes: Sequence[PromptOutcome], ks: Sequence[int],
              voted: bool) -> dict[str, float]:
    """The metrics over prompts: `pass_at_<j>` for each j in `ks`, `avg` (avg@k:
    each prompt's mean reward over its scored samples, averaged over the prompts
    that have one) and, if `voted` (the task gives final answers), `maj` (maj@k:
    the share of prompts whose voted answer is correct). Every prompt must hold
    at least max(ks) samples."""
    if not outcomes:
        raise ValueError("outcomes: no prompts were evaluated")
    out: dict[str, float] = {}
    for j in sorted(set(ks)):
        out[f"pass_at_{j}"] = sum(pass_at_k(o.num_samples, o.num_correct, j)
                                  for o in outcomes) / len(outcomes)
    means = [o.reward_sum / o.num_scored for o in outcomes if o.num_scored]
    out["avg"] = sum(means) / len(means) if means else 0.0
    if voted:
        out["maj"] = sum(o.majority_correct for o in outcomes) / len(outcomes)
    return out
