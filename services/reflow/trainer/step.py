"""One optimiser step on a leased batch (paper §4.1 step 3), alone or as one
replica of the data-parallel trainer group (trainer/dp.py).

The replay weights (τ, renormalised) and the token normalisation are computed
over the whole batch on every rank, so each rank's share of the loss is
exactly its share of the batch's; the summed gradients are the whole batch's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from reflow.core.config import JobSpec
from reflow.core.types import Trajectory
from reflow.trainer.loss import LossStats, grpo_token_loss, replay_sample_weights, token_logprobs

if TYPE_CHECKING:
    from reflow.trainer.dp import TrainerGroup

STAT_NAMES = ("clip_fraction", "approx_kl", "ratio_mean")


@dataclass
class TensorBatch:
    input_ids: torch.Tensor  # [B, T]
    attention_mask: torch.Tensor  # [B, T]
    old_logprobs: torch.Tensor  # [B, T-1], aligned with targets input_ids[:, 1:]
    loss_mask: torch.Tensor  # [B, T-1]
    advantages: torch.Tensor  # [B]


def collate(trajectories: list[Trajectory], pad_id: int, device: torch.device) -> TensorBatch:
    """Right-pad prompt+response sequences; logprobs and masks are placed on the
    positions that predict each response token."""
    length = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    n = len(trajectories)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    old = torch.zeros((n, length - 1), dtype=torch.float32)
    mask = torch.zeros((n, length - 1), dtype=torch.float32)
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, : p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        attention[i, : p + r] = 1
        # Position j predicts token j+1, so response token k sits at p-1+k.
        old[i, p - 1 : p - 1 + r] = torch.tensor(t.logprobs)
        mask[i, p - 1 : p - 1 + r] = torch.tensor(t.loss_mask, dtype=torch.float32)
    adv = torch.tensor([t.advantage for t in trajectories], dtype=torch.float32)
    return TensorBatch(
        input_ids.to(device), attention.to(device), old.to(device), mask.to(device), adv.to(device))


def plan_micro_batches(lengths: list[int], max_tokens: int | None) -> list[list[int]]:
    """Indices of a step's sequences cut into micro-batches of at most `max_tokens`
    padded tokens (sequences x longest), longest first, so each pads only to
    sequences of about its own length. A sequence longer than the budget goes alone."""
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    if max_tokens is None:
        return [order] if order else []
    plan: list[list[int]] = []
    for i in order:
        # Sorted longest first: a micro-batch's first sequence is its longest.
        if plan and (len(plan[-1]) + 1) * lengths[plan[-1][0]] <= max_tokens:
            plan[-1].append(i)
        else:
            plan.append([i])
    return plan


def compute_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: JobSpec,
                 trajectories: list[Trajectory], pad_id: int, device: torch.device,
                 group: TrainerGroup | None = None):
    """Gradient of this rank's share of the batch, summed over the group, then one
    clipped optimizer step. Returns ((LossStats, grad_norm), per-sample stats);
    every rank returns the same."""
    # Replayed samples weigh τ, then the batch is renormalised (paper §4.1), over
    # the whole step's batch before it is cut into shares and micro-batches.
    weights = replay_sample_weights(
        torch.tensor([t.uses for t in trajectories], dtype=torch.long),
        torch.tensor([t.num_tokens for t in trajectories], dtype=torch.long),
        spec.replay.replay_weight).to(device)
    batch_tokens = float(sum(t.num_tokens for t in trajectories))
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    mine = list(range(len(trajectories)))
    if group is not None and group.world_size > 1:
        from reflow.trainer.dp import shard_indices

        mine = shard_indices(lengths, group.rank, group.world_size)
    plan = [[mine[j] for j in chunk] for chunk in
            plan_micro_batches([lengths[i] for i in mine],
                               spec.trainer.max_tokens_per_micro_batch)]
    optimizer.zero_grad(set_to_none=True)
    # [loss, clip_fraction, approx_kl, ratio_mean], then per sample (ratio, clipped):
    # summed across ranks with the gradients (each sample is computed by one rank).
    totals = torch.zeros(1 + len(STAT_NAMES) + 2 * len(trajectories), dtype=torch.float64)
    per_sample = totals[1 + len(STAT_NAMES):].view(len(trajectories), 2)
    for indices in plan:
        tb = collate([trajectories[i] for i in indices], pad_id, device)
        logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits
        # The engine sampled from softmax(logits / T); score under the same law.
        logits = logits[:, :-1] / spec.rollout.temperature
        new_logprobs = token_logprobs(logits, tb.input_ids[:, 1:])
        loss, stats = grpo_token_loss(
            new_logprobs, tb.old_logprobs, tb.advantages, tb.loss_mask,
            spec.trainer.clip_eps, sample_weights=weights[indices],
            num_batch_tokens=batch_tokens)
        loss.backward()  # gradients accumulate: the sum is the whole batch's
        totals[0] += stats.loss
        share = float(tb.loss_mask.sum()) / max(batch_tokens, 1.0)
        for k, name in enumerate(STAT_NAMES, start=1):
            totals[k] += getattr(stats, name) * share
        with torch.no_grad():
            ratio = torch.exp((new_logprobs - tb.old_logprobs) * tb.loss_mask) * tb.loss_mask
            clipped = ((ratio - 1.0).abs() > spec.trainer.clip_eps) * tb.loss_mask
            denom = tb.loss_mask.sum(-1).clamp(min=1.0)
            per_sample[indices, 0] = (ratio.sum(-1) / denom).double().cpu()
            per_sample[indices, 1] = (clipped.sum(-1) / denom).double().cpu()
    if group is not None and group.world_size > 1:
        totals = group.sum_gradients(model, totals).cpu()
        per_sample = totals[1 + len(STAT_NAMES):].view(len(trajectories), 2)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.trainer.max_grad_norm)
    optimizer.step()
    stats = LossStats(loss=float(totals[0]),
                      **{name: float(totals[k]) for k, name in enumerate(STAT_NAMES, start=1)})
    rows = per_sample.tolist()
    sample_stats = {
        t.sample_id: {"ratio_mean": rows[i][0], "clip_fraction": rows[i][1],
                      "loss_weight": float(weights[i])}
        for i, t in enumerate(trajectories)
    }
    return (stats, float(grad_norm)), sample_stats
