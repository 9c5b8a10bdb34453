"""Policy losses (the registered `policy_loss` plug-ins) and how their token
terms become one step's loss (aggregation).

A loss sees, per micro-batch, the trainer's log-probs (with autograd), the
proximal log-probs it clips against (detached: the behaviour policy's, or a
recomputed or interpolated one, algorithms/correction.py), the sample
advantages and the loss mask. It returns a loss term per token and which
tokens its clip cut off from the gradient. Importance weights, replay weights
(τ, paper §4.1 step 3) and the aggregation over the batch are applied around
it, the same for every loss, so a loss plug-in is only its objective.

Signs: terms are *losses* (minimised), -A·ratio for PPO's surrogate.
Shapes: log-probs and mask [B, T]; advantages [B].
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch

from reflow.core.algorithm_config import Aggregation


@dataclass
class ClipRange:
    """The ratio's band [1 - low, 1 + high] (ε_low, ε_high)."""

    low: float
    high: float


class PolicyLoss(ABC):
    """The interface of a policy loss plug-in (kind `policy_loss`).

    `default_aggregation` and `default_clip_high` apply where the spec leaves
    `algorithm.loss_aggregation` or `algorithm.clip_eps_high` unset (None: the
    clip is symmetric, trainer.clip_eps on both sides)."""

    default_aggregation: Aggregation = "token_mean"
    default_clip_high: float | None = None

    @abstractmethod
    def token_terms(self, new_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
                    advantages: torch.Tensor, mask: torch.Tensor,
                    clip: ClipRange) -> tuple[torch.Tensor, torch.Tensor]:
        """(loss per token [B, T], True where the clip zeroed the token's gradient)."""


def _clipped_surrogate(ratio: torch.Tensor, adv: torch.Tensor, clip: ClipRange):
    """PPO's pessimistic surrogate as a loss, and where the clipped side wins with a
    flat slope: ratio above 1 + ε_high with A > 0, or below 1 - ε_low with A < 0.
    Only those tokens lose their gradient; a ratio outside the band on the other
    side of the advantage still trains (verl's pg_clipfrac, TRL's clip_ratio)."""
    unclipped = -ratio * adv
    clipped = -torch.clamp(ratio, 1.0 - clip.low, 1.0 + clip.high) * adv
    zeroed = ((ratio > 1.0 + clip.high) & (adv > 0)) | ((ratio < 1.0 - clip.low) & (adv < 0))
    return torch.maximum(unclipped, clipped), zeroed


class GRPOLoss(PolicyLoss):
    """PPO's clipped token ratio against the proximal policy, token-level
    aggregation (the DAPO form GRPO trainers use today)."""

    def token_terms(self, new_logprobs, proximal_logprobs, advantages, mask, clip):
        log_ratio = (new_logprobs - proximal_logprobs) * mask
        ratio = torch.exp(log_ratio)
        return _clipped_surrogate(ratio, advantages.unsqueeze(-1), clip)


class DAPOLoss(GRPOLoss):
    """DAPO: GRPO's surrogate with the upper clip raised (clip-higher, ε_high 0.28
    against ε_low 0.2) so that unlikely tokens with positive advantage can grow;
    token-level aggregation over the batch (Yu et al., 2025)."""

    default_clip_high = 0.28


class DrGRPOLoss(GRPOLoss):
    """Dr. GRPO: the same surrogate, each sequence's token sum divided by a
    constant instead of its own length (no length bias), paired with advantages
    without the std division (Liu et al., 2025)."""

    default_aggregation: Aggregation = "seq_mean_token_sum_norm"


class GSPOLoss(PolicyLoss):
    """GSPO: one ratio per sequence, the geometric mean of its tokens' ratios,
    clipped as a whole (Zheng et al., 2025). In GSPO-token form, the value of
    each token's ratio is the sequence's and its gradient the token's own:
    s_i,t = sg[s_i] · π(y_t) / sg[π(y_t)]. GSPO's paper clips at 3e-4 / 4e-4."""

    default_aggregation: Aggregation = "seq_mean_token_mean"

    def token_terms(self, new_logprobs, proximal_logprobs, advantages, mask, clip):
        log_ratio = (new_logprobs - proximal_logprobs) * mask
        lengths = mask.sum(-1).clamp(min=1.0)
        seq_log_ratio = (log_ratio.sum(-1) / lengths).unsqueeze(-1)
        token_log_ratio = seq_log_ratio.detach() + new_logprobs - new_logprobs.detach()
        ratio = torch.exp(token_log_ratio.clamp(max=20.0))
        return _clipped_surrogate(ratio, advantages.unsqueeze(-1), clip)


class CISPOLoss(PolicyLoss):
    """CISPO: the ratio, capped at 1 + ε_high, as a stop-gradient weight on each
    token's log-probability, -sg[min(r, 1 + ε_high)]·A·log π (MiniMax-M1, 2025,
    which sets no lower bound: ε_low is not used). No token loses its gradient
    to the cap; a large ratio only stops growing its weight."""

    default_clip_high = 0.28

    def token_terms(self, new_logprobs, proximal_logprobs, advantages, mask, clip):
        ratio = torch.exp((new_logprobs - proximal_logprobs) * mask)
        weight = torch.clamp(ratio, max=1.0 + clip.high).detach()
        terms = -weight * advantages.unsqueeze(-1) * new_logprobs
        return terms, torch.zeros_like(mask, dtype=torch.bool)


@dataclass(frozen=True)
class Denominators:
    """The whole step's counts a micro-batch's sum is divided by, so that
    micro-batches' (and ranks') losses sum to the batch's: gradient
    accumulation changes nothing."""

    tokens: float  # loss tokens in the batch
    sequences: float  # sequences with at least one loss token
    constant: float  # seq_mean_token_sum_norm's per-sequence divisor


def aggregate(terms: torch.Tensor, mask: torch.Tensor, mode: Aggregation,
              denominators: Denominators) -> torch.Tensor:
    """The step's loss share of a micro-batch's weighted token terms [B, T]
    (weights already applied):
    - token_mean: Σ_i Σ_t m_it ℓ_it / (batch loss tokens);
    - seq_mean_token_mean: Σ_i (Σ_t m_it ℓ_it / Σ_t m_it) / (batch sequences);
    - seq_mean_token_sum_norm: Σ_i (Σ_t m_it ℓ_it / L) / (batch sequences), L constant.
    A sequence without loss tokens adds nothing in any mode."""
    masked = (terms * mask).sum(-1)
    if mode == "token_mean":
        return masked.sum() / max(denominators.tokens, 1.0)
    if mode == "seq_mean_token_mean":
        per_seq = masked / mask.sum(-1).clamp(min=1.0)
    elif mode == "seq_mean_token_sum_norm":
        per_seq = masked / denominators.constant
    else:
        raise ValueError(f"algorithm.loss_aggregation: unknown mode {mode!r}")
    return per_seq.sum() / max(denominators.sequences, 1.0)
