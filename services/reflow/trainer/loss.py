"""Policy-gradient losses.

Token-level GRPO (the DAPO form): every loss token of the batch counts once,
so long responses are not down-weighted against short ones. The importance
ratio is taken against the behaviour logprobs each trajectory carries, which
is what makes stale samples usable (paper §4.1 step 3).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LossStats:
    loss: float
    clip_fraction: float
    approx_kl: float
    ratio_mean: float


def grpo_token_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    sample_weights: torch.Tensor | None = None,
    num_batch_tokens: float | None = None,
) -> tuple[torch.Tensor, LossStats]:
    """Clipped-ratio policy loss averaged over loss tokens.

    Shapes: logprobs and mask are [batch, tokens]; advantages and
    sample_weights are [batch]. `sample_weights` scale each sample's tokens
    (1 when omitted). For a micro-batch of a larger step, `num_batch_tokens` is
    the whole step's loss-token count, so the micro-batches' losses (and their
    gradients) sum to the step's; the stats stay per micro-batch token.

    loss = -Σ_i Σ_t w_i m_it min(ρ_it A_i, clip(ρ_it, 1-ε, 1+ε) A_i) / Σ_i Σ_t m_it,
    ρ_it = exp(new_it - old_it).
    """
    mask = mask.to(new_logprobs.dtype)
    log_ratio = (new_logprobs - old_logprobs) * mask
    ratio = torch.exp(log_ratio)
    adv = advantages.unsqueeze(-1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - clip_eps, 1.0 + clip_eps) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if sample_weights is not None:
        per_token = per_token * sample_weights.unsqueeze(-1)
    num_tokens = mask.sum().clamp(min=1.0)
    loss = (per_token * mask).sum() / (num_tokens if num_batch_tokens is None
                                       else max(float(num_batch_tokens), 1.0))
    with torch.no_grad():
        was_clipped = ((ratio - 1.0).abs() > clip_eps).to(mask.dtype) * mask
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float(was_clipped.sum() / num_tokens),
            # k3 estimator of KL(behaviour || current), per token.
            approx_kl=float((((ratio - 1.0) - log_ratio) * mask).sum() / num_tokens),
            ratio_mean=float((ratio * mask).sum() / num_tokens),
        )
    return loss, stats


def replay_sample_weights(
    uses: torch.Tensor,
    num_tokens: torch.Tensor,
    replay_weight: float,
    base_weights: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sample loss weights of paper §4.1: w_i = ω_i for unused samples
    (uses == 0) and τ·ω_i for replayed ones, normalised by
    Z = Σ_j w_j n_j / Σ_j n_j so that Σ_j w̃_j n_j = Σ_j n_j: replay changes the
    mix of the gradient, not its overall scale.

    `base_weights` are the ω_i (1 when omitted); `num_tokens` the n_i.
    """
    omega = torch.ones_like(num_tokens, dtype=torch.float32) if base_weights is None else base_weights
    w = torch.where(uses > 0, replay_weight * omega, omega)
    n = num_tokens.to(torch.float32)
    z = (w * n).sum() / n.sum().clamp(min=1.0)
    if z <= 0:
        # Only replayed samples with τ = 0: nothing to learn from this batch.
        return torch.zeros_like(w)
    return w / z


def token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """log p(target) per position, without materialising a full log-softmax copy."""
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)
