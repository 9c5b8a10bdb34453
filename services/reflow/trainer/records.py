"""One training step's metrics record (`metrics.jsonl`, the status the scheduler
polls, Prometheus): what the batch held, where the step's time went, what the
engines did meanwhile, and the buffer's counters after it."""

from __future__ import annotations

import math
import time
from typing import Any

from reflow.core.types import Batch


def _first_use_reward(rewards: list[float]) -> dict[str, float]:
    return {"first_use_reward_mean": sum(rewards) / len(rewards)} if rewards else {}


def step_record(loop, batch: Batch, stats, wait_s: float, train_s: float, sync_s: float,
             sync_wait_s: float, step_s: float, rollout_delta: list[float],
             wall_s: float) -> dict[str, Any]:
    loss_stats, grad_norm = stats
    (rollout_idle_s, occupancy_s, generated_tokens, finished_samples, busy_s, decode_steps,
     filtered_groups, active) = rollout_delta
    trajs = batch.trajectories
    scored = [t for t in trajs if not t.reward_error]
    trained_tokens = sum(t.num_tokens for t in trajs)
    # Tokens of samples trained for the first time: replay trains some tokens
    # again, so this is the rate new rollouts turn into training.
    first_use_tokens = sum(t.num_tokens for t in trajs if t.uses == 0)
    # Staleness against the version the batch was leased (and trained) under,
    # from each sample's oldest segment: the policy lag the loss corrects for.
    staleness = [batch.policy_version - t.oldest_version for t in trajs]
    replayed = sum(1 for t in trajs if t.uses > 0)
    fresh = sum(1 for t, s in zip(trajs, staleness) if t.uses == 0 and s == 0)
    histogram: dict[str, int] = {}
    for s in staleness:
        histogram[str(s)] = histogram.get(str(s), 0) + 1
    buffer = loop.replay.stats(loop.job_id)
    num_workers = max(1, int(active))
    startup: dict[str, float] = {}
    if loop.step == 1:
        # Start-up, once, apart from the steady state: this trainer's model and
        # optimizer, and the slowest rollout engine's build.
        startup = {"trainer_startup_s": loop.startup_s,
                   "engine_startup_s": max((c.stats(loop.job_id).engine_startup_s
                                            for c in loop.rollouts), default=0.0)}
    return {
        **startup,
        "step": loop.step,
        "policy_version": loop.policy_version,
        # Over the scored samples: one without a reward (reward_error) is excluded
        # from the loss and from this mean (rollout/scoring.py).
        "reward_mean": sum(t.reward for t in scored) / len(scored) if scored else 0.0,
        # The same over samples trained for the first time (absent from a batch of
        # replays only): a replayed sample's reward was counted when it was first
        # trained, so a learning curve reads this one.
        **_first_use_reward([t.reward for t in scored if t.uses == 0]),
        "reward_error_samples": len(trajs) - len(scored),
        "optimizer_step_skipped": not math.isfinite(grad_norm),
        "trained_tokens": trained_tokens,
        "step_time_s": step_s,
        "trainer_tokens_per_s": trained_tokens / step_s if step_s > 0 else 0.0,
        "first_use_tokens": first_use_tokens,
        "first_use_tokens_per_s": first_use_tokens / step_s if step_s > 0 else 0.0,
        # The rate the step trained at (trainer.lr_schedule, trainer/schedule.py).
        "learning_rate": loop.learning_rate,
        # Waiting for a batch, and for the rollout workers to pause for a weight
        # update: the trainer computes nothing in either.
        "trainer_idle_ratio": min(1.0, (wait_s + sync_wait_s) / step_s) if step_s > 0 else 0.0,
        "rollout_idle_ratio": min(1.0, rollout_idle_s / (step_s * num_workers)) if step_s > 0 else 0.0,
        # The engines' measured batch occupancy over this step (running requests
        # over the concurrency cap), averaged over the workers.
        "rollout_utilisation": min(1.0, occupancy_s / (step_s * num_workers)) if step_s > 0 else 0.0,
        # The share of the step the engines had a request running, averaged over the
        # workers: the rest of a generation phase is the job's own work around the
        # engine (dispatch, scoring, puts, the lease).
        "rollout_busy_ratio": min(1.0, busy_s / (step_s * num_workers)) if step_s > 0 else 0.0,
        **engine_step_fields(busy_s, decode_steps, generated_tokens),
        # Tokens the engines generated during this step (kept or not): generation
        # throughput, the adaptive scheduler's yardstick (paper §6.1).
        "generated_tokens": int(generated_tokens),
        # Samples the engines finished during this step: production, for placement.
        "generated_samples": int(finished_samples),
        # Groups dynamic sampling dropped during this step (algorithm.dynamic_sampling).
        "filtered_groups": int(filtered_groups),
        "rollout_workers": num_workers,
        # The trainer group this step ran on (paper §5's elastic pool).
        "trainer_workers": loop.group_size,
        "membership_epoch": loop.membership_epoch,
        # Faults the job went on through: the trainer group broke by a member's
        # loss (its step trained again), and lost workers' engines that left.
        "trainer_group_breaks": loop.group_failures,
        "retired_engines": len(loop.retired_engines),
        "rollout_engines": len(loop.rollouts),
        "generation_tokens_per_s": generated_tokens / step_s if step_s > 0 else 0.0,
        "fresh_samples": fresh,
        "stale_samples": len(trajs) - fresh - replayed,
        "replay_samples": replayed,
        "replay_fraction": replayed / len(trajs),
        "max_staleness": max(staleness),
        "staleness_counts": histogram,
        "wall_time_s": wall_s,
        # Unix time of the record: wall_time_s restarts with a restarted trainer.
        "recorded_at": time.time(),
        "batch_wait_s": wait_s,
        # The optimisation itself (forward, backward, optimizer step, across the
        # group); the rest of a step besides waits and the sync is bookkeeping.
        "train_s": train_s,
        "weight_sync_s": sync_s,
        "sync_wait_s": sync_wait_s,
        # What one sync moves to each engine (the adapters alone with LoRA), and the
        # largest mean |Δ log-prob| of an engine's probe at the last check (sync_check.py).
        "weight_sync_bytes": loop.sync_bytes,
        "sync_check_logprob_diff": loop.last_sync_check,
        "unused_pool_samples": buffer.unused_samples,
        "replay_pool_samples": buffer.replay_samples,
        "evicted_samples_total": buffer.evicted_total,
        "evicted_unused_samples_total": buffer.evicted_unused_total,
        "dispatched_samples_total": buffer.dispatched_total,
        # The buffer's ledger (trainer/checkpoint.py keeps it with each checkpoint):
        # samples put, and samples out on a lease now.
        "put_samples_total": buffer.put_total,
        "leased_samples": buffer.leased_samples,
        "trained_unused_samples_total": buffer.trained_unused_total,
        "filter_dropped_samples_total": buffer.dropped_total,
        "outstanding_leases": buffer.outstanding_leases,
        "loss": loss_stats.loss,
        # Loss tokens whose gradient the clip zeroed, and k3 KL(behaviour || trainer).
        "clip_fraction": loss_stats.clip_fraction,
        "approx_kl": loss_stats.approx_kl,
        # Off-policy figures (algorithms/correction.py): mismatch_kl, importance_ess,
        # masked_fraction, entropy, loss_tokens, each also per slice (fresh_, stale_,
        # replayed_) where the batch has that slice.
        **loss_stats.offpolicy,
        # k3 KL to the frozen reference per loss token (0 with trainer.kl_coef 0),
        # and the memory that reference holds.
        "kl": loss_stats.kl,
        "reference_model_bytes": loop.reference_bytes,
        "grad_norm": grad_norm,
        "response_len_mean": sum(len(t.response_ids) for t in trajs) / len(trajs),
        # The batch's length distribution: the long tail a synchronous step waits
        # on, and what a simulation's length model (sim/costs.py) is fitted to.
        **_length_quantiles(sorted(len(t.response_ids) for t in trajs)),
    }


def engine_step_fields(busy_s: float, decode_steps: float, generated_tokens: float) -> dict:
    """The engines' mean decode step over a training step and the sequences it
    decoded at once (tokens a step), from their busy seconds, steps and tokens:
    the decode cost in the job itself, beside the engine benchmarked alone
    (sim/calibrate.py). Empty when the engines counted no steps."""
    if decode_steps <= 0:
        return {}
    return {"engine_step_ms": busy_s / decode_steps * 1e3,
            "engine_step_sequences": generated_tokens / decode_steps}


def _length_quantiles(lengths: list[int]) -> dict[str, int]:
    """p10, p50, p90 and the longest of sorted response lengths (nearest rank)."""
    def at(q: float) -> int:
        return lengths[min(len(lengths) - 1, max(0, math.ceil(q * len(lengths)) - 1))]

    return {"response_len_p10": at(0.1), "response_len_p50": at(0.5),
            "response_len_p90": at(0.9), "response_len_max": lengths[-1]}
