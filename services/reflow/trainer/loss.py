"""The trainer's loss around a policy-loss plug-in (reflow.algorithms.losses):
replay weights (τ, paper §4.1 step 3), importance weights, aggregation over
the whole step's batch, an optional KL penalty towards a frozen reference
model (the k3 estimator, as verl's `low_var_kl`); and token log-probabilities.
`grpo_token_loss` is the original loss (token-level GRPO against the
behaviour log-probs) in one call.

Token log-probabilities come either from full logits (`token_logprobs`) or
from the last hidden states a chunk of positions at a time
(`chunked_token_logprobs`), which never holds a micro-batch's full-vocabulary
logits; this module does not know how a model produces either.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch.utils.checkpoint import checkpoint

from reflow.algorithms.losses import (Aggregation, ClipRange, Denominators, GRPOLoss, PolicyLoss,
                                      aggregate)

# exp() of a larger reference-minus-policy log-ratio overflows float32's useful
# range; verl clamps at the same bound. Only tokens the reference finds ~e^20
# times likelier than the policy are affected.
MAX_KL_LOG_RATIO = 20.0


@dataclass
class LossStats:
    loss: float
    # Loss tokens whose gradient the clip zeroed (verl's pg_clipfrac, TRL's clip_ratio).
    clip_fraction: float
    approx_kl: float
    ratio_mean: float
    # k3 KL to the reference model per loss token (0 without one).
    kl: float = 0.0
    # The step's off-policy figures, whole batch and per slice (algorithms/correction.py).
    offpolicy: dict[str, float] = field(default_factory=dict)


def reference_kl(new_logprobs: torch.Tensor, ref_logprobs: torch.Tensor,
                 mask: torch.Tensor) -> torch.Tensor:
    """k3 estimate of KL(policy || reference) per token, zero where `mask` is 0:
    exp(ref - new) - (ref - new) - 1, which is >= 0, unbiased for the KL under
    samples from the policy, and of low variance (Schulman's k3)."""
    mask = mask.to(new_logprobs.dtype)
    # Masked before exp(): padding positions hold arbitrary logprobs.
    log_ratio = ((ref_logprobs - new_logprobs) * mask).clamp(-MAX_KL_LOG_RATIO, MAX_KL_LOG_RATIO)
    return (torch.exp(log_ratio) - log_ratio - 1.0) * mask


def policy_loss(loss: PolicyLoss, new_logprobs: torch.Tensor, proximal_logprobs: torch.Tensor,
                advantages: torch.Tensor, mask: torch.Tensor, clip: ClipRange,
                aggregation: Aggregation, denominators: Denominators,
                token_weights: torch.Tensor | None = None,
                sample_weights: torch.Tensor | None = None,
                ref_logprobs: torch.Tensor | None = None,
                kl_coef: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """A micro-batch's share of the step's loss, and the tokens the clip zeroed.

    loss = agg_i,t( w_i · c_it · ℓ_it ) + β · agg_i,t( k3_it ),
    ℓ the loss plug-in's token terms against π_prox, w_i the replay weights
    (τ, normalised, paper §4.1), c_it the importance weights (correction.py),
    k3 the KL to the frozen reference when β = trainer.kl_coef > 0. The KL
    term is not weighted: it regularises the current policy wherever it is
    evaluated, whatever the sample's provenance."""
    mask = mask.to(new_logprobs.dtype)
    terms, zeroed = loss.token_terms(new_logprobs, proximal_logprobs, advantages, mask, clip)
    if token_weights is not None:
        terms = terms * token_weights
    if sample_weights is not None:
        terms = terms * sample_weights.unsqueeze(-1)
    total = aggregate(terms, mask, aggregation, denominators)
    if ref_logprobs is not None and kl_coef > 0.0:
        kl = reference_kl(new_logprobs, ref_logprobs, mask)
        total = total + kl_coef * aggregate(kl, mask, aggregation, denominators)
    return total, zeroed


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
    """The `grpo` loss against the behaviour log-probs, token-mean aggregation:

    loss = -Σ_i Σ_t w_i m_it min(ρ_it A_i, clip(ρ_it, 1-ε, 1+ε) A_i) / Σ_i Σ_t m_it,
    ρ_it = exp(new_it - old_it); plus β Σ m k3 / (the same count) with a reference.

    For a micro-batch of a larger step, `num_batch_tokens` is the whole step's
    loss-token count, so the micro-batches' losses (and their gradients) sum to
    the step's; the stats stay per micro-batch token."""
    mask = mask.to(new_logprobs.dtype)
    num_tokens = float(mask.sum().clamp(min=1.0))
    denominators = Denominators(
        tokens=num_tokens if num_batch_tokens is None else float(num_batch_tokens),
        sequences=1.0, constant=1.0)
    loss, zeroed = policy_loss(GRPOLoss(), new_logprobs, old_logprobs, advantages, mask,
                               ClipRange(clip_eps, clip_eps), "token_mean", denominators,
                               sample_weights=sample_weights, ref_logprobs=ref_logprobs,
                               kl_coef=kl_coef)
    with torch.no_grad():
        log_ratio = (new_logprobs - old_logprobs) * mask
        ratio = torch.exp(log_ratio)
        kl = (reference_kl(new_logprobs, ref_logprobs, mask).sum() / num_tokens
              if ref_logprobs is not None and kl_coef > 0.0 else 0.0)
        stats = LossStats(
            loss=float(loss.detach()),
            clip_fraction=float((zeroed * mask).sum() / num_tokens),
            # k3 estimator of KL(behaviour || current), per token.
            approx_kl=float((((ratio - 1.0) - log_ratio) * mask).sum() / num_tokens),
            ratio_mean=float((ratio * mask).sum() / num_tokens),
            kl=float(kl),
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


def token_entropy(logits: torch.Tensor) -> torch.Tensor:
    """The policy's entropy per position, H = logsumexp(z) - Σ softmax(z) z, without
    autograd: a metric (how far sampling is from collapsing), not a loss term."""
    with torch.no_grad():
        logits = logits.detach().float()
        return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, -1) * logits).sum(-1)


def suppressed_stop_correction(logits: torch.Tensor, stop_ids: torch.Tensor) -> torch.Tensor:
    """log(1 - Σ_{s ∈ stops} p_s) per position of float32 `logits` [..., V]: what a
    token's log-prob gains where the engine sampled with the stop tokens masked
    (min_tokens, core.types.Trajectory.min_tokens). Differentiable: under
    min_tokens the policy *is* the masked law."""
    log_stop = torch.logsumexp(logits[..., stop_ids], dim=-1) - torch.logsumexp(logits, dim=-1)
    # A position where the stops hold all the mass cannot have sampled a non-stop token.
    return torch.log1p(-torch.exp(log_stop).clamp(max=1.0 - 1e-6))


def _chunk_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                    temperature: float, suppress: torch.Tensor | None = None,
                    stop_ids: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    # Divided before the cast, as the full-logits path does: the same numbers.
    logits = (head(hidden) / temperature).float()
    picked = torch.gather(logits, -1, targets.unsqueeze(-1)).squeeze(-1)
    logprobs = picked - torch.logsumexp(logits, dim=-1)
    if suppress is not None:
        logprobs = logprobs - suppress * suppressed_stop_correction(logits, stop_ids)
    return logprobs, token_entropy(logits)


def chunked_token_logprobs(hidden: torch.Tensor, targets: torch.Tensor, head: torch.nn.Module,
                           temperature: float = 1.0, chunk_tokens: int = 1024,
                           with_entropy: bool = False, suppress: torch.Tensor | None = None,
                           stop_ids: torch.Tensor | None = None):
    """log softmax(head(hidden) / temperature)[target] per position, `chunk_tokens`
    positions at a time (and with `with_entropy`, the entropy of that softmax per
    position, detached: a (logprobs, entropy) pair). Where `suppress` [B, T] is 1
    the law is that softmax without the `stop_ids` (suppressed_stop_correction).

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
    flat_suppress = suppress.reshape(batch * length) if suppress is not None else None
    keep_graph = torch.is_grad_enabled()
    pieces, entropies = [], []
    for start in range(0, batch * length, chunk_tokens):
        h = flat_hidden[start:start + chunk_tokens]
        t = flat_targets[start:start + chunk_tokens]
        sup = flat_suppress[start:start + chunk_tokens] if flat_suppress is not None else None
        if sup is not None and not bool(sup.any()):
            sup = None
        if keep_graph:
            logp, ent = checkpoint(_chunk_logprobs, h, t, head, temperature, sup, stop_ids,
                                   use_reentrant=False)
        else:
            logp, ent = _chunk_logprobs(h, t, head, temperature, sup, stop_ids)
        pieces.append(logp)
        entropies.append(ent)
    if not pieces:
        empty = hidden.new_zeros((batch, length), dtype=torch.float32)
        return (empty, empty.clone()) if with_entropy else empty
    logprobs = torch.cat(pieces).view(batch, length)
    return (logprobs, torch.cat(entropies).view(batch, length)) if with_entropy else logprobs
