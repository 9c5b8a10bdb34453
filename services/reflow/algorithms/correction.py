"""Off-policy correction: the stage between a batch and the loss (paper §4.1
step 3, where stale and replayed samples enter the gradient).

Every token carries the log-prob the engine sampled it with (behaviour, π_b)
and the policy version it was sampled under. The loss clips its ratio against
a *proximal* policy π_prox (decoupled PPO, Hilton et al. 2022; AReaL):
- `behaviour`: π_prox = π_b, ratio π_θ / π_b (verl's bypass mode; ReFlow's
  original loss). A token sampled several versions back, or by an engine whose
  numerics differ from the trainer's, has a ratio far from 1 and the clip drops
  its gradient.
- `recompute`: π_prox = the trainer's policy at the start of the step. With one
  optimizer step per batch that is the step's own forward, detached, so it
  costs nothing; with trainer.num_minibatches > 1 a no-grad pass scores the
  batch before the first minibatch (trainer/step.py).
- `interpolate`: AReaL's log-linear approximation from versions, without that
  pass: log π_prox = log π_b + α (log π_θ - log π_b), α = (u_prox - u_b) /
  (u_θ - u_b) in optimizer updates, u_b the update count of the token's version.

The gap π_prox / π_b is then corrected by importance weights (raw, truncated
at C: TIS, or masked outside [floor, C]: MIS) per token, per sequence (product)
or per sequence as a geometric mean. Weights are detached: they scale a
token's gradient, they are not optimised.

`OffPolicyTally` counts, per slice of the batch (fresh, stale, replayed),
what the correction saw: the trainer-vs-behaviour mismatch (k3 KL, the
importance ratio's effective sample size), clipped and masked tokens, entropy.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from reflow.core.algorithm_config import AlgorithmConfig

# exp() of a larger log-ratio overflows float32's useful range (as loss.MAX_KL_LOG_RATIO).
MAX_LOG_WEIGHT = 20.0
SLICES = ("fresh", "stale", "replayed")


@dataclass(frozen=True)
class UpdateClock:
    """Where the trainer stands in optimizer updates, for `interpolate`: u_prox
    (updates before this step), u_θ (before this minibatch) and the updates one
    policy version spans (sync_interval × num_minibatches)."""

    proximal: int
    current: int
    per_version: int

    def version_updates(self, versions: torch.Tensor) -> torch.Tensor:
        return versions.to(torch.float64) * self.per_version


def proximal_logprobs(config: AlgorithmConfig, new_logprobs: torch.Tensor,
                      behaviour: torch.Tensor, recomputed: torch.Tensor | None = None,
                      versions: torch.Tensor | None = None,
                      clock: UpdateClock | None = None) -> torch.Tensor:
    """π_prox's log-probs [B, T], detached. `recomputed`: the no-grad pass's (None:
    the step's own forward is the proximal, one optimizer step per batch);
    `versions` [B, T] each token's behaviour version and `clock`, for interpolate."""
    new = new_logprobs.detach()
    if config.proximal == "behaviour":
        return behaviour
    if config.proximal == "recompute":
        return new if recomputed is None else recomputed
    if versions is None or clock is None:
        raise ValueError("algorithm.proximal=interpolate needs each token's version")
    u_b = clock.version_updates(versions)
    span = clock.current - u_b
    # A token sampled by the weights being trained (span 0), or at or before the
    # proximal: α = 1 means π_prox = π_θ, exact before the step's first update.
    alpha = torch.where(span > 0, (clock.proximal - u_b) / span.clamp(min=1e-9),
                        torch.ones_like(span)).clamp(0.0, 1.0).to(new.dtype)
    return behaviour + alpha * (new - behaviour)


def importance_weights(config: AlgorithmConfig, proximal: torch.Tensor, behaviour: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(weights [B, T] or None, masked-out tokens [B, T] bool or None), detached.
    Weight = π_prox / π_b per token, or per sequence (exp of the sum of its
    tokens' log-ratios, or of their mean for `geometric`), then truncated or
    masked."""
    if config.importance_mode == "off":
        return None, None
    log_w = (proximal - behaviour).detach() * mask
    if config.importance_level != "token":
        total = log_w.sum(-1, keepdim=True)
        if config.importance_level == "geometric":
            total = total / mask.sum(-1, keepdim=True).clamp(min=1.0)
        log_w = total.expand_as(mask)
    weights = torch.exp(log_w.clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
    floor, cap = config.importance_bounds
    if config.importance_mode == "truncate":
        return weights.clamp(max=cap), None
    if config.importance_mode == "mask":
        outside = ((weights > cap) | (weights < floor)) & (mask > 0)
        return weights.masked_fill(outside, 0.0), outside
    return weights, None


def sample_slices(staleness: list[int], uses: list[int]) -> torch.Tensor:
    """Each sample's slice index into SLICES: replayed (trained before), stale
    (first use, generated under an older version), fresh."""
    return torch.tensor([2 if u > 0 else (1 if s > 0 else 0)
                         for s, u in zip(staleness, uses)], dtype=torch.long)


# Columns of the tally: sums over loss tokens of one slice.
_FIELDS = ("tokens", "mismatch_kl", "clipped", "masked", "ratio", "ratio_sq", "entropy")


class OffPolicyTally:
    """Sums per slice (row 0 the whole batch, then SLICES) that add across
    micro-batches and ranks (`as_tensor` / `from_tensor` for the all-reduce)."""

    def __init__(self) -> None:
        self.sums = torch.zeros(1 + len(SLICES), len(_FIELDS), dtype=torch.float64)

    def add(self, slices: torch.Tensor, mask: torch.Tensor, new_logprobs: torch.Tensor,
            behaviour: torch.Tensor, clipped: torch.Tensor, masked: torch.Tensor | None,
            entropy: torch.Tensor | None) -> None:
        """One micro-batch: `slices` [B], the rest [B, T]. The mismatch is the
        trainer's policy before this update against the behaviour policy:
        ρ = π_θ / π_b, k3 = (ρ - 1) - log ρ, an estimate of KL(π_b || π_θ)."""
        with torch.no_grad():
            m = mask.to(torch.float64)
            log_rho = ((new_logprobs.detach() - behaviour) * mask).to(torch.float64)
            rho = torch.exp(log_rho.clamp(-MAX_LOG_WEIGHT, MAX_LOG_WEIGHT))
            columns = [m, ((rho - 1.0) - log_rho) * m, clipped.to(torch.float64) * m,
                       (masked.to(torch.float64) * m if masked is not None else m * 0.0),
                       rho * m, rho * rho * m,
                       (entropy.detach().to(torch.float64) * m if entropy is not None
                        else m * 0.0)]
            per_sample = torch.stack([c.sum(-1) for c in columns], dim=-1).cpu()  # [B, F]
            self.sums[0] += per_sample.sum(0)
            self.sums[1:].index_add_(0, slices.cpu(), per_sample)

    def as_tensor(self) -> torch.Tensor:
        return self.sums.flatten()

    def load(self, flat: torch.Tensor) -> None:
        self.sums = flat.to(torch.float64).view_as(self.sums).clone()

    def metrics(self) -> dict[str, float]:
        """The batch's `clip_fraction`, `mismatch_kl`, `importance_ess`,
        `masked_fraction`, `entropy`, and the same prefixed by each non-empty
        slice (`replayed_mismatch_kl`). `importance_ess` is the normalised
        effective sample size of the token ratios ρ, (Σρ)² / (n Σρ²): 1 when
        trainer and behaviour agree, towards 0 as a few tokens dominate."""
        out: dict[str, float] = {}
        for row, prefix in enumerate(("", *(f"{s}_" for s in SLICES))):
            tokens, kl, clipped, masked, ratio, ratio_sq, entropy = self.sums[row].tolist()
            if tokens <= 0:
                continue
            out[f"{prefix}loss_tokens" if prefix else "loss_tokens"] = tokens
            out[f"{prefix}mismatch_kl"] = kl / tokens
            out[f"{prefix}clip_fraction"] = clipped / tokens
            out[f"{prefix}masked_fraction"] = masked / tokens
            out[f"{prefix}importance_ess"] = ratio * ratio / (tokens * ratio_sq) if ratio_sq else 1.0
            out[f"{prefix}entropy"] = entropy / tokens
        return out
