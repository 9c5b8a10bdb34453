"""Policy-gradient losses.

Token-level GRPO (the DAPO form): every loss token of the batch counts once,
so long responses are not down-weighted against short ones. The importance
ratio is taken against the behaviour logprobs each trajectory carries, which
is what makes stale samples usable (paper §4.1 step 3). An optional KL
penalty pulls the policy towards a frozen reference model (the k3 estimator,
as verl's `low_var_kl`).

Token log-probabilities come either from full logits (`token_logprobs`) or
from the last hidden states a chunk of positions at a time
(`chunked_token_logprobs`), which never holds a micro-batch's full-vocabulary
logits; this module does not know how a model produces either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

# exp() of a larger reference-minus-policy log-ratio overflows float32's useful
# range; verl clamps at the same bound. Only tokens the reference finds ~e^20
# times likelier than the policy are affected.
MAX_KL_LOG_RATIO = 20.0


@dataclass
class LossStats:
    loss: float
    clip_fraction: float
    approx_kl: float
    ratio_mean: float
    # k3 KL to the reference model per loss token (0 without one).
    kl: float = 0.0


def reference_kl(new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(policy || reference) per token, zero where `mask` is 0:
    exp(ref - new) - (ref - new) - 1, which is >= 0, unbiased for the KL under
    samples from the policy, and of low variance (Schulman's k3)."""
    mask = mask.to(new_logprobs.dtype)
    # Masked before exp(): padding positions hold arbitrary logprobs.
    log_ratio = ((ref_logprobs - new_logprobs) * mask).clamp(-MAX_KL_LOG_RATIO, MAX_KL_LOG_RATIO)
    return (torch.exp(log_ratio) - log_ratio - 1.0) * mask


def grpo_token_loss(
    new_logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_eps: float,
    sample_weights: torch.Tensor | None = None,
    num_batch_tokens: float | None = None,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
) -> tuple[torch.Tensor, LossStats]:
    """Clipped-ratio policy loss averaged over loss tokens.

    Shapes: logprobs and mask are [batch, tokens]; advantages and
    sample_weights are [batch]. `sample_weights` scale each sample's tokens
    (1 when omitted). For a micro-batch of a larger step, `num_batch_tokens` is
    the whole step's loss-token count, so the micro-batches' losses (and their
    gradients) sum to the step's; the stats stay per micro-batch token.

    loss = -Σ_i Σ_t w_i m_it min(ρ_it A_i, clip(ρ_it, 1-ε, 1+ε) A_i) / Σ_i Σ_t m_it,
    ρ_it = exp(new_it - old_it).

    With `ref_logprobs` and `kl_coef` β > 0 the loss gains
    β Σ_i Σ_t m_it k3_it / (the same token count), k3 from `reference_kl`. The
    KL term is not scaled by `sample_weights`: it regularises the current policy
    wherever it is evaluated, whatever the sample's provenance, and the weights
    are normalised to keep the token scale anyway.
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
    denom = num_tokens if num_batch_tokens is None else max(float(num_batch_tokens), 1.0)
    loss = (per_token * mask).sum() / denom
    kl = None
    if ref_logprobs is not None and kl_coef > 0.0:
        kl = reference_kl(new_logprobs, ref_logprobs, mask)
        loss = loss + kl_coef * kl.sum() / denom
    with torch.no_grad():
        was_clipped = ((ratio - 1.0).abs() > clip_eps).to(mask.dtype) * mask
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float(was_clipped.sum() / num_tokens),
            # k3 estimator of KL(behaviour || current), per token.
            approx_kl=float((((ratio - 1.0) - log_ratio) * mask).sum() / num_tokens),
            ratio_mean=float((ratio * mask).sum() / num_tokens),
            kl=float(kl.sum() / num_tokens) if kl is not None else 0.0,
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
    """log p(target) per position, without materialising a full log-softmax copy
    (but with a float32 copy of `logits`)."""
    logits = logits.float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                    temperature: float) -> torch.Tensor:
    # Divided before the cast, as the full-logits path does: the same numbers.
    logits = (head(hidden) / temperature).float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    return picked - torch.logsumexp(logits, dim=-1)


def chunked_token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                           temperature: float = 1.0, chunk_tokens: int = 1024) -> torch.Tensor:
    """log softmax(head(hidden) / temperature)[target] per position, `chunk_tokens`
    positions at a time.

    Shapes: hidden [B, T, H], targets [B, T] -> [B, T] float32. With autograd on,
    each chunk runs under a non-reentrant checkpoint, so the backward pass keeps
    only the chunk's slice of `hidden` and recomputes its
    logits: peak logits memory is one chunk's [chunk_tokens, V] in float32 (plus
    its gradient), not the micro-batch's [B, T, V]. Equals `token_logprobs` of
    the full logits divided by `temperature`.
    """
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens: {chunk_tokens}; need >= 1")
    batch, length = targets.shape
    flat_hidden = hidden.reshape(batch * length, hidden.shape[-1])
    flat_targets = targets.reshape(batch * length)
    keep_graph = torch.is_grad_enabled()
    pieces = []
    for start in range(0, batch * length, chunk_tokens):
        h = flat_hidden[start:start + chunk_tokens]
        t = flat_targets[start:start + chunk_tokens]
        if keep_graph:
            pieces.append(checkpoint(_chunk_logprobs, h, t, head, temperature,
                                     use_reentrant=False))
        else:
            pieces.append(_chunk_logprobs(h, t, head, temperature))
    if not pieces:
        return hidden.new_zeros((batch, length), dtype=torch.float32)
    return torch.cat(pieces).view(batch, length)
