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
import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from reflow.algorithms.correction import (OffPolicyTally, UpdateClock, importance_weights,
                                          proximal_logprobs, sample_slices)
from reflow.algorithms.losses import Aggregation, ClipRange, Denominators, PolicyLoss
from reflow.core import plugins
from reflow.core.config import JobSpec
from reflow.core.types import Trajectory
from reflow.trainer.loss import (LossStats, chunked_token_logprobs, policy_loss, reference_kl,
                                 replay_sample_weights, suppressed_stop_correction, token_entropy,
                                 token_logprobs)

if TYPE_CHECKING:
    from reflow.trainer.dp import TrainerGroup

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
    # The policy version each response token was sampled under, [B, T-1] (0 elsewhere).
    versions: torch.Tensor | None = None
    # A recomputed proximal policy's log-probs, [B, T-1], where one was scored.
    proximal: torch.Tensor | None = None
    # 1 where the engine sampled with the stop tokens masked (min_tokens), [B, T-1].
    suppress: torch.Tensor | None = None


def collate(trajectories: list[Trajectory], pad_id: int, device: torch.device,
            proximal: list[torch.Tensor] | None = None) -> TensorBatch:
    """Right-pad prompt+response sequences; logprobs, masks and versions are placed
    on the positions that predict each response token. `proximal`: each
    trajectory's recomputed log-probs of its response tokens."""
    length = max(len(t.prompt_ids) + len(t.response_ids) for t in trajectories)
    n = len(trajectories)
    input_ids = torch.full((n, length), pad_id, dtype=torch.long)
    attention = torch.zeros((n, length), dtype=torch.long)
    old = torch.zeros((n, length - 1), dtype=torch.float32)
    mask = torch.zeros((n, length - 1), dtype=torch.float32)
    versions = torch.zeros((n, length - 1), dtype=torch.float32)
    suppress = torch.zeros((n, length - 1), dtype=torch.float32)
    prox = torch.zeros((n, length - 1), dtype=torch.float32) if proximal is not None else None
    for i, t in enumerate(trajectories):
        p, r = len(t.prompt_ids), len(t.response_ids)
        input_ids[i, : p + r] = torch.tensor(t.prompt_ids + t.response_ids)
        attention[i, : p + r] = 1
        # Position j predicts token j+1, so response token k sits at p-1+k.
        old[i, p - 1 : p - 1 + r] = torch.tensor(t.logprobs)
        mask[i, p - 1 : p - 1 + r] = torch.tensor(t.loss_mask, dtype=torch.float32)
        versions[i, p - 1 : p - 1 + r] = torch.tensor(
            [float(s.policy_version) for s in t.segments for _ in range(s.num_tokens)])
        if prox is not None:
            prox[i, p - 1 : p - 1 + r] = proximal[i].to(torch.float32).cpu()
        if t.min_tokens:
            suppress[i, p - 1 : p - 1 + r] = torch.tensor(_suppressed(t.loss_mask, t.min_tokens))
    adv = torch.tensor([t.advantage for t in trajectories], dtype=torch.float32)
    return TensorBatch(
        input_ids.to(device), attention.to(device), old.to(device), mask.to(device), adv.to(device),
        versions.to(device), prox.to(device) if prox is not None else None, suppress.to(device))


def _suppressed(loss_mask: list[int], min_tokens: int) -> list[float]:
    """1.0 at the first `min_tokens` tokens of each policy turn (each run of loss-mask
    ones): where the engine sampled with the stop tokens masked."""
    out, run = [], 0
    for m in loss_mask:
        run = run + 1 if m else 0
        out.append(1.0 if m and run <= min_tokens else 0.0)
    return out


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
                      chunk_tokens: int | None, with_entropy: bool = False,
                      suppress: torch.Tensor | None = None,
                      stop_ids: torch.Tensor | None = None):
    """log p(input_ids[:, t+1] | input_ids[:, :t+1]) under softmax(logits / T),
    [B, T-1] float32: the law the engine sampled from, which where `suppress`
    [B, T-1] is 1 excludes the `stop_ids` (min_tokens). With `with_entropy`, a
    (logprobs, entropy) pair, the entropy of that law per position, detached.

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
        logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
        logprobs = token_logprobs(logits / temperature, input_ids[:, 1:])
        if suppress is not None and stop_ids is not None and bool(suppress.any()):
            logprobs = logprobs - suppress * suppressed_stop_correction(
                (logits / temperature).float(), stop_ids)
        return (logprobs, token_entropy(logits / temperature)) if with_entropy else logprobs
    # No KV cache: nothing is generated, and the backward keeps K and V anyway.
    hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                              use_cache=False).last_hidden_state
    if stop_ids is None:
        suppress = None
    return chunked_token_logprobs(hidden[:, :-1], input_ids[:, 1:], head, temperature,
                                  chunk_tokens, with_entropy, suppress, stop_ids)


def _objective(spec: JobSpec) -> tuple[PolicyLoss, Aggregation, ClipRange]:
    """The spec's loss plug-in, aggregation and clip band (algorithm section, its
    unset fields taken from the loss's defaults)."""
    alg = spec.algorithm
    loss = plugins.build("policy_loss", alg.loss, alg.loss_args, field="algorithm.loss",
                         args_field="algorithm.loss_args")
    high = alg.clip_eps_high or loss.default_clip_high or spec.trainer.clip_eps
    return (loss, alg.loss_aggregation or loss.default_aggregation,
            ClipRange(spec.trainer.clip_eps, high))


def _minibatches(n: int, num: int) -> list[list[int]]:
    """Batch positions cut into `num` contiguous minibatches of equal size."""
    size = n // num
    return [list(range(j * size, (j + 1) * size if j < num - 1 else n)) for j in range(num)]


def compute_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: JobSpec,
                 trajectories: list[Trajectory], pad_id: int, device: torch.device,
                 group: TrainerGroup | None = None, **options):
    """`_compute_step`. With an FSDP group, a collective FSDP runs that fails (a
    rank died: its sockets closed) is the group breaking, as a failed collective
    of TrainerGroup's own is (dp.GroupBroken): the FSDP units go back to their
    sharded parameters, which no optimizer step has touched, and the leader
    rebuilds the group (an hsdp group from the surviving replicas)."""
    if group is None or not getattr(group, "sharded", False):
        return _compute_step(model, optimizer, spec, trajectories, pad_id, device, group,
                             **options)
    from reflow.trainer.dp import GroupBroken
    from reflow.trainer.fsdp import collective_failed, reshard_units

    try:
        return _compute_step(model, optimizer, spec, trajectories, pad_id, device, group,
                             **options)
    except GroupBroken:
        reshard_units(model)  # left by the leader mid-step (TrainerReplica.leave)
        raise
    except RuntimeError as err:
        if not collective_failed(err):
            raise
        reshard_units(model)
        raise GroupBroken(f"an FSDP collective failed: {err}"[:2000]) from err


def _compute_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, spec: JobSpec,
                  trajectories: list[Trajectory], pad_id: int, device: torch.device,
                  group: TrainerGroup | None = None,
                  reference: torch.nn.Module | None = None, step: int | None = None,
                  stop_ids: list[int] | None = None):
    """Gradient of this rank's share of the batch, summed over the group, then one
    clipped optimizer step per minibatch (trainer.num_minibatches). Returns
    ((LossStats, grad_norm), per-sample stats); every rank returns the same.
    `reference`: the frozen initial model, needed when `trainer.kl_coef` > 0.
    `step`: the step being trained (1-based), which places the batch's tokens in
    versions and optimizer updates (staleness slices, `interpolate`). With an
    FSDP group (fsdp.ShardedGroup) `model` is its root (fsdp.PolicyScorer) and
    FSDP sums the gradients. `stop_ids`: the model's stop tokens, which the engine
    masks under a sample's min_tokens (models/tokens.py); the trainer scores those
    positions under the same masked law."""
    kl_coef = spec.trainer.kl_coef
    if kl_coef > 0.0 and reference is None:
        raise ValueError("trainer.kl_coef > 0 needs the reference model; this trainer "
                         "was built without one")
    alg = spec.algorithm
    loss_fn, aggregation, clip = _objective(spec)
    chunk = spec.trainer.logprob_chunk_tokens
    temperature = spec.rollout.temperature
    num_mini = spec.trainer.num_minibatches
    sync_interval = spec.trainer.sync_interval
    if step is None:  # a lone call: the batch's newest version is the trainer's
        step = max((t.newest_version for t in trajectories), default=0) * sync_interval + 1
    version = (step - 1) // sync_interval
    slices = sample_slices([version - t.oldest_version for t in trajectories],
                           [t.uses for t in trajectories])
    lengths = [len(t.prompt_ids) + len(t.response_ids) for t in trajectories]
    constant = float(alg.aggregation_tokens or spec.rollout.longest_response)
    sharded = getattr(group, "sharded", False)
    spread = group is not None and group.world_size > 1

    stops = (torch.tensor(stop_ids, dtype=torch.long, device=device)
             if stop_ids and any(t.min_tokens for t in trajectories) else None)

    def score(net, ids, mask, with_entropy=False, suppress=None):
        suppress = suppress if stops is not None else None
        if sharded and net is model:  # the FSDP root scores in its own forward
            return net(ids, mask, temperature, chunk, with_entropy, suppress, stops)
        return sequence_logprobs(net, ids, mask, temperature, chunk, with_entropy, suppress,
                                 stops)

    def plan_for(positions: list[int]) -> list[list[int]]:
        mine = positions
        if spread:
            from reflow.trainer.dp import shard_indices

            mine = [positions[i] for i in shard_indices([lengths[i] for i in positions],
                                                        group.rank, group.world_size)]
        plan = [[mine[j] for j in part] for part in
                plan_micro_batches([lengths[i] for i in mine],
                                   spec.trainer.max_tokens_per_micro_batch)]
        # FSDP gathers each unit's parameters in a collective per forward and
        # backward: every rank runs as many passes as the busiest, the extra ones on
        # an empty micro-batch (trainer/fsdp.py).
        if sharded:
            plan += [[]] * (group.max_int(len(plan)) - len(plan))
        return plan

    minibatches = _minibatches(len(trajectories), num_mini)
    plans = [plan_for(mb) for mb in minibatches]
    # Decoupled PPO with several updates per batch: the proximal policy is the
    # weights before the first, scored once for every token this rank trains.
    recomputed: dict[int, torch.Tensor] = {}
    if alg.proximal == "recompute" and num_mini > 1:
        with torch.no_grad():
            for plan in plans:
                for indices in plan:
                    if not indices:
                        ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
                        score(model, ids, torch.ones_like(ids))
                        continue
                    tb = collate([trajectories[i] for i in indices], pad_id, device)
                    logprobs = score(model, tb.input_ids, tb.attention_mask,
                                     suppress=tb.suppress)
                    for row, i in enumerate(indices):
                        p, r = len(trajectories[i].prompt_ids), len(trajectories[i].response_ids)
                        recomputed[i] = logprobs[row, p - 1:p - 1 + r].detach()

    tally = OffPolicyTally()
    # [loss, kl token sum, ratio sum], the tally, then per sample (ratio, clipped):
    # summed across ranks with the gradients (each sample is computed by one rank).
    num_head = 3
    per_sample_local = torch.zeros(len(trajectories), 2, dtype=torch.float64)
    losses = torch.zeros(num_head, dtype=torch.float64)
    weights_all = torch.zeros(len(trajectories))
    grad_norms: list[float] = []
    for j, (positions, plan) in enumerate(zip(minibatches, plans)):
        # Replayed samples weigh τ, then the minibatch is renormalised (paper §4.1),
        # over the whole minibatch before it is cut into shares and micro-batches.
        weights = replay_sample_weights(
            torch.tensor([trajectories[i].uses for i in positions], dtype=torch.long),
            torch.tensor([trajectories[i].num_tokens for i in positions], dtype=torch.long),
            spec.replay.replay_weight)
        weights_all[positions] = weights
        weights = weights_all.to(device)
        denominators = Denominators(
            tokens=float(sum(trajectories[i].num_tokens for i in positions)),
            sequences=float(sum(1 for i in positions if trajectories[i].num_tokens > 0)),
            constant=constant)
        clock = UpdateClock(proximal=(step - 1) * num_mini, current=(step - 1) * num_mini + j,
                            per_version=sync_interval * num_mini)
        optimizer.zero_grad(set_to_none=True)
        for indices in plan:
            if not indices:  # a pass that only keeps an FSDP group in step; adds nothing
                ids = torch.full((1, 2), pad_id, dtype=torch.long, device=device)
                (score(model, ids, torch.ones_like(ids)).sum() * 0.0).backward()
                continue
            tb = collate([trajectories[i] for i in indices], pad_id, device,
                         [recomputed[i] for i in indices] if recomputed else None)
            ref_logprobs = None
            if kl_coef > 0.0:
                with torch.no_grad():
                    ref_logprobs = score(reference, tb.input_ids, tb.attention_mask,
                                         suppress=tb.suppress)
            # The engine sampled from softmax(logits / T); score under the same law.
            new_logprobs, entropy = score(model, tb.input_ids, tb.attention_mask, True,
                                          tb.suppress)
            proximal = proximal_logprobs(alg, new_logprobs, tb.old_logprobs, tb.proximal,
                                         tb.versions, clock)
            token_weights, masked = importance_weights(alg, proximal, tb.old_logprobs,
                                                       tb.loss_mask)
            loss, zeroed = policy_loss(
                loss_fn, new_logprobs, proximal, tb.advantages, tb.loss_mask, clip,
                aggregation, denominators, token_weights=token_weights,
                sample_weights=weights[indices], ref_logprobs=ref_logprobs, kl_coef=kl_coef)
            loss.backward()  # gradients accumulate: the sum is the minibatch's
            with torch.no_grad():
                mask = tb.loss_mask
                losses[0] += float(loss) / num_mini
                if ref_logprobs is not None:
                    losses[1] += float(reference_kl(new_logprobs, ref_logprobs, mask).sum())
                ratio = torch.exp((new_logprobs - tb.old_logprobs) * mask) * mask
                losses[2] += float(ratio.sum())
                tally.add(slices[indices], mask, new_logprobs, tb.old_logprobs, zeroed, masked,
                          entropy)
                denom = mask.sum(-1).clamp(min=1.0)
                # Each sample is in one minibatch: set once.
                per_sample_local[indices, 0] = (ratio.sum(-1) / denom).double().cpu()
                per_sample_local[indices, 1] = ((zeroed * mask).sum(-1) / denom).double().cpu()
        last = j == num_mini - 1
        extra = (torch.cat([losses, tally.as_tensor(), per_sample_local.flatten()]) if last
                 else torch.zeros(1, dtype=torch.float64))
        if sharded:  # the gradients are reduce-scattered already, by FSDP
            extra = group.all_reduce_sum(extra).cpu() if last else extra
        elif spread:
            extra = group.sum_gradients(model, extra).cpu()
        grad_norms.append(_optimizer_step(model, optimizer, spec.trainer.max_grad_norm))
    losses, rest = extra[:num_head], extra[num_head:]
    tally.load(rest[:tally.as_tensor().numel()])
    rows = rest[tally.as_tensor().numel():].view(len(trajectories), 2).tolist()
    offpolicy = tally.metrics()
    tokens = max(offpolicy.get("loss_tokens", 0.0), 1.0)
    stats = LossStats(loss=float(losses[0]), clip_fraction=offpolicy.get("clip_fraction", 0.0),
                      approx_kl=offpolicy.get("mismatch_kl", 0.0),
                      ratio_mean=float(losses[2]) / tokens, kl=float(losses[1]) / tokens,
                      offpolicy=offpolicy)
    finite = [g for g in grad_norms if math.isfinite(g)]
    grad_norm = sum(finite) / len(finite) if len(finite) == len(grad_norms) else \
        next(g for g in grad_norms if not math.isfinite(g))
    sample_stats = {
        t.sample_id: {"ratio_mean": rows[i][0], "clip_fraction": rows[i][1],
                      "loss_weight": float(weights_all[i])}
        for i, t in enumerate(trajectories)
    }
    return (stats, grad_norm), sample_stats


def _optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                    max_grad_norm: float) -> float:
    """Clip the summed gradient and step; returns its norm before clipping."""
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    if hasattr(grad_norm, "full_tensor"):  # sharded gradients: a DTensor, the same on all
        grad_norm = grad_norm.full_tensor()
    if torch.isfinite(grad_norm):
        optimizer.step()
    else:
        # A NaN or inf gradient would become NaN weights on every engine at the next
        # sync: this step changes nothing (every rank sees the same summed norm).
        logger.warning("non-finite gradient norm (%s): optimizer step skipped", float(grad_norm))
        optimizer.zero_grad(set_to_none=True)
    return float(grad_norm)
