"""One optimiser step on a leased batch (paper §4.1 step 3), alone or as one
replica of the data-parallel trainer group (trainer/dp.py).

The replay weights (τ, renormalised) and the token normalisation are computed
over the whole batch on every rank, so each rank's share of the loss is
exactly its share of the batch's; the summed gradients are the whole batch's.

Token log-probabilities are taken from the model's last hidden states in
chunks of positions (`trainer.logprob_chunk_tokens`, loss.chunked_token_logprobs),
so no micro-batch's full-vocabulary logits exist at once; with a KL penalty
the frozen reference model is scored the same way, without autograd.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from reflow.core.config import JobSpec
from reflow.core.types import Trajectory
from reflow.trainer.loss import (LossStats, chunked_token_logprobs, grpo_token_loss,
                                 replay_sample_weights, token_logprobs)

if TYPE_CHECKING:
    from reflow.trainer.dp import TrainerGroup

STAT_NAMES = ("clip_fraction", "approx_kl", "ratio_mean", "kl")
# Config fields of architectures whose logits are more than lm_head(last hidden
# state) (Gemma's soft-capping, Cohere's and Granite's scales): those models are
# scored through their own forward, which applies them.
_LOGIT_TRANSFORMS = ("final_logit_softcapping", "logit_scale", "logits_scaling")

logger = logging.getLogger(__name__)
_warned_full_logits: set[str] = set()


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


def _plain_head(model: torch.nn.Module) -> torch.nn.Module | None:
    """The output projection when the model's logits are exactly
    head(base_model(...).last_hidden_state); None otherwise."""
    config = getattr(model, "config", None)
    base = getattr(model, "base_model", model)
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if config is None or base is model or head is None:
        return None
    for name in _LOGIT_TRANSFORMS:
        if getattr(config, name, None) not in (None, 1, 1.0):
            return None
    return head


def sequence_logprobs(model: torch.nn.Module, input_ids: torch.Tensor,
                      attention_mask: torch.Tensor, temperature: float,
                      chunk_tokens: int | None) -> torch.Tensor:
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) under softmax(logits / T),
    [B, T-1] float32: the law the engine sampled from.

    `chunk_tokens` None (or a model whose logits are not a plain projection):
    the model's full logits, [B, T, V], then a float32 copy of them. Otherwise
    the base model's last hidden states go through the output projection
    `chunk_tokens` positions at a time (loss.chunked_token_logprobs)."""
    head = _plain_head(model) if chunk_tokens is not None else None
    if head is None:
        if chunk_tokens is not None and type(model).__name__ not in _warned_full_logits:
            _warned_full_logits.add(type(model).__name__)
            logger.warning("%s: logits are not a plain projection; scoring full logits",
                           type(model).__name__)
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits
        return token_logprobs(logits[:, :-1] / temperature, input_ids[:, 1:])
    # No KV cache: nothing is generated, and the backward keeps K and V anyway.
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              use_cache=False).last_hidden_state
    return chunked_token_logprobs(hidden[:, :-1], input_ids[:, 1:], head, temperature,
                                  chunk_tokens)


def compute_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: JobSpec,
                 trajectories: list[Trajectory], pad_id: int, device: torch.device,
                 group: TrainerGroup | None = None,
                 reference: torch.nn.Module | None = None):
    """Gradient of this rank's share of the batch, summed over the group, then one
    clipped optimizer step. Returns ((LossStats, grad_norm), per-sample stats);
    every rank returns the same. `reference`: the frozen initial model, needed
    when `trainer.kl_coef` > 0. With an FSDP group (fsdp.ShardedGroup) `model`
    is its root (fsdp.PolicyScorer) and FSDP sums the gradients."""
    kl_coef = spec.trainer.kl_coef
    if kl_coef > 0.0 and reference is None:
        raise ValueError("trainer.kl_coef > 0 needs the reference model; this trainer "
                         "was built without one")
    chunk = spec.trainer.logprob_chunk_tokens
    temperature = spec.rollout.temperature
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
    # FSDP gathers each unit's parameters in a collective per forward and
    # backward: every rank runs as many passes as the busiest, the extra ones on
    # an empty micro-batch (trainer/fsdp.py).
    sharded = getattr(group, "sharded", False)
    if sharded:
        plan += [[]] * (group.max_int(len(plan)) - len(plan))

    def score(net, ids, mask):
        if sharded and net is model:  # the FSDP root scores in its own forward
            return net(ids, mask, temperature, chunk)
        return sequence_logprobs(net, ids, mask, temperature, chunk)

    optimizer.zero_grad(set_to_none=True)
    # [loss, clip_fraction, approx_kl, ratio_mean, kl], then per sample (ratio, clipped):
    # summed across ranks with the gradients (each sample is computed by one rank).
    totals = torch.zeros(1 + len(STAT_NAMES) + 2 * len(trajectories), dtype=torch.float64)
    per_sample = totals[1 + len(STAT_NAMES):].view(len(trajectories), 2)
    for indices in plan:
        if not indices:  # a pass that only keeps an FSDP group in step; adds nothing
            ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
            (score(model, ids, torch.ones_like(ids)).sum() * 0.0).backward()
            continue
        tb = collate([trajectories[i] for i in indices], pad_id, device)
        ref_logprobs = None
        if kl_coef > 0.0:
            with torch.no_grad():
                ref_logprobs = score(reference, tb.input_ids, tb.attention_mask)
        # The engine sampled from softmax(logits / T); score under the same law.
        new_logprobs = score(model, tb.input_ids, tb.attention_mask)
        loss, stats = grpo_token_loss(
            new_logprobs, tb.old_logprobs, tb.advantages, tb.loss_mask,
            spec.trainer.clip_eps, sample_weights=weights[indices],
            num_batch_tokens=batch_tokens, ref_logprobs=ref_logprobs, kl_coef=kl_coef)
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
    if sharded:  # the gradients are reduce-scattered already, by FSDP
        totals = group.all_reduce_sum(totals).cpu()
        per_sample = totals[1 + len(STAT_NAMES):].view(len(trajectories), 2)
    elif group is not None and group.world_size > 1:
        totals = group.sum_gradients(model, totals).cpu()
        per_sample = totals[1 + len(STAT_NAMES):].view(len(trajectories), 2)
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), spec.trainer.max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # sharded gradients: a DTensor, the same on all
        grad_norm = grad_norm.full_tensor()
    if torch.isfinite(grad_norm):
        optimizer.step()
    else:
        # A NaN or inf gradient would become NaN weights on every engine at the next
        # sync: this step changes nothing (every rank sees the same summed norm).
        logger.warning("non-finite gradient norm (%s): optimizer step skipped", float(grad_norm))
        optimizer.zero_grad(set_to_none=True)
    stats = LossStats(loss=float(totals[0]),
                      **{name: float(totals[k]) for k, name in enumerate(STAT_NAMES, start=1)})
    rows = per_sample.tolist()
    sample_stats = {
        t.sample_id: {"ratio_mean": rows[i][0], "clip_fraction": rows[i][1],
                      "loss_weight": float(weights[i])}
        for i, t in enumerate(trajectories)
    }
    return (stats, float(grad_norm)), sample_stats
