"""The training loop (paper §4.1 steps 3-4).

Each step: lease a batch from the replay buffer, take one optimiser step on
the clipped-ratio GRPO loss, release the lease, and every `sync_interval`
steps publish a new policy version (weights to every rollout worker over
torch.distributed, then the version to the buffer). One metrics record per
step goes to `metrics.jsonl` and to the status the scheduler polls.

The loop reaches the buffer and the rollout workers only through their
clients; it never sees gRPC.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from reflow.core.config import JobSpec
from reflow.core.types import Batch, Trajectory
from reflow.procs import free_port
from reflow.replay.client import ReplayClient
from reflow.rollout.engine import WeightSyncSpec
from reflow.trainer.loss import LossStats, grpo_token_loss, replay_sample_weights, token_logprobs
from reflow.weightsync import DEFAULT_BUCKET_BYTES, make_group, send_weights, specs_of

RECENT_METRICS_STEPS = 4096

logger = logging.getLogger(__name__)


class JobStopped(Exception):
    """The job was asked to stop."""


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


class TrainLoop:
    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        replay: ReplayClient,
        rollouts: list[Any],
        run_dir: str | None = None,
        device: torch.device | None = None,
        master_address: str = "127.0.0.1",
        metrics: Any = None,
    ) -> None:
        self.job_id = job_id
        self.spec = spec
        self.replay = replay
        self.rollouts = rollouts
        self.run_dir = Path(run_dir) if run_dir else None
        self.device = device or torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.master_address = master_address
        self.metrics = metrics
        self.step = 0
        self.policy_version = 0
        self.startup_s = 0.0
        # Recent per-step records for the scheduler, which polls about once a second
        # and copies them into the job store; bounded so a lost poller costs no memory.
        self.recent_metrics: deque[dict[str, Any]] = deque(maxlen=RECENT_METRICS_STEPS)
        self._stop = threading.Event()
        self._sync_group = None
        self._pool = ThreadPoolExecutor(max_workers=max(1, len(rollouts)), thread_name_prefix="wsync")

    def stop(self) -> None:
        self._stop.set()

    # --- set-up ----------------------------------------------------------------

    def load(self) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        started = time.monotonic()
        torch.manual_seed(self.spec.seed)
        if self.device.type == "cpu":
            # One OpenMP thread per core this process may use (see procs.split_cpus).
            torch.set_num_threads(max(1, len(os.sched_getaffinity(0))))
        dtype = getattr(torch, self.spec.model.dtype)
        # model.path is confined under the models root (TrainerService); never reach the Hub.
        path = self.spec.model.path
        self.tokenizer = AutoTokenizer.from_pretrained(  # nosec B615 # local dir only
            path, local_files_only=True)
        self.model = AutoModelForCausalLM.from_pretrained(  # nosec B615 # local dir only
            path, dtype=dtype, local_files_only=True)
        self.model.to(self.device)
        self.model.train()
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(),
            lr=self.spec.trainer.learning_rate,
            weight_decay=self.spec.trainer.weight_decay,
        )
        self.pad_id = self.tokenizer.pad_token_id or 0
        # Start-up (model and optimizer built), reported with the first step.
        self.startup_s = time.monotonic() - started
        # The buffer composes batches and evicts by these settings (σ, δ, plug-ins).
        self.replay.configure(self.job_id, self.spec.replay)

    def init_weight_sync(self) -> None:
        """Build the broadcast group: trainer rank 0, rollout worker i rank i+1."""
        named = self._named_weights()
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        port = free_port()
        world = 1 + len(self.rollouts)
        tensors = [(s.name, list(s.shape), s.dtype) for s in specs_of(named)]
        futures = [
            self._pool.submit(
                client.init_weight_sync,
                self.job_id,
                WeightSyncSpec(self.master_address, port, i + 1, world, backend, tensors,
                               DEFAULT_BUCKET_BYTES),
            )
            for i, client in enumerate(self.rollouts)
        ]
        self._sync_group = make_group(self.master_address, port, 0, world, backend)
        for f in futures:
            f.result()
        logger.info("job %s: weight sync group ready (%s, %d ranks)", self.job_id, backend, world)

    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        # named_parameters() lists a tied lm_head once, under the embedding's name,
        # which is what the engines' checkpoint loaders expect.
        return [(n, p) for n, p in self.model.named_parameters()]

    # --- the loop -----------------------------------------------------------------

    def run(self) -> None:
        start = time.monotonic()
        rollout_before = self._rollout_totals()
        # A step's time runs from the previous step's end to this one's, so the work
        # between steps (metrics, stats calls) counts against throughput too.
        previous_end = time.monotonic()
        while self.step < self.spec.trainer.num_steps:
            if self._stop.is_set():
                raise JobStopped()
            step_start = time.monotonic()
            # 1. Wait for a batch; the wait is the trainer's idle time.
            batch = self._lease_batch()
            wait_s = time.monotonic() - step_start
            released = False
            try:
                # 2. Optimise, renewing the lease meanwhile: a step longer than the lease
                #    must not see its samples handed back and trained again as fresh.
                with self._lease_kept(batch):
                    stats, sample_stats = self._train_step(batch)
                # 3. Release: the samples are trained; the buffer's replay filter sees
                #    each one's training stats and decides whether it comes back.
                self.replay.release(self.job_id, batch.lease_id, sample_stats)
                released = True
            finally:
                if not released:
                    self._give_back(batch)
            self.step += 1
            # 4. Publish a new policy version every sync_interval steps.
            sync_s = 0.0
            if self.step % self.spec.trainer.sync_interval == 0:
                sync_s = self._publish()
            step_end = time.monotonic()
            step_s, previous_end = step_end - previous_end, step_end
            rollout_now = self._rollout_totals()
            record = self._metrics(batch, stats, wait_s, sync_s, step_s,
                                   [now - before for now, before in zip(rollout_now, rollout_before)],
                                   time.monotonic() - start)
            rollout_before = rollout_now
            self._emit(record)

    def _give_back(self, batch: Batch) -> None:
        """A batch that will not be trained (the job stopped or the step failed)
        goes back to the buffer at once instead of waiting out its lease."""
        try:
            self.replay.return_lease(self.job_id, batch.lease_id)
        except Exception as err:  # noqa: BLE001 - the lease still expires on its own
            logger.warning("job %s: could not return lease %s (%s); it expires in %.0fs",
                           self.job_id, batch.lease_id, err, self.spec.replay.lease_ttl_s)

    def _lease_batch(self) -> Batch:
        deadline = time.monotonic() + self.spec.trainer.batch_timeout_s
        while not self._stop.is_set():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"no batch of {self.spec.trainer.batch_size} samples within "
                    f"trainer.batch_timeout_s={self.spec.trainer.batch_timeout_s:.0f}s"
                )
            batch = self.replay.sample(
                self.job_id, self.spec.trainer.batch_size, self.spec.replay.lease_ttl_s,
                timeout_s=min(remaining, 5.0),
            )
            if batch is not None:
                return batch
            self._check_rollouts()
        raise JobStopped()

    @contextlib.contextmanager
    def _lease_kept(self, batch: Batch):
        """Renew `batch`'s lease every third of its TTL until the block ends."""
        ttl = self.spec.replay.lease_ttl_s
        done = threading.Event()

        def renew() -> None:
            while not done.wait(ttl / 3):
                try:
                    if not self.replay.renew_lease(self.job_id, batch.lease_id, ttl):
                        logger.warning("job %s: lease %s is gone; its samples went back",
                                       self.job_id, batch.lease_id)
                        return
                except Exception as err:  # noqa: BLE001 - the next tick tries again
                    logger.warning("job %s: lease renewal failed: %s", self.job_id, err)

        keeper = threading.Thread(target=renew, name="lease-renew", daemon=True)
        keeper.start()
        try:
            yield
        finally:
            done.set()

    def _check_rollouts(self) -> None:
        for client in self.rollouts:
            stats = client.stats(self.job_id)
            if stats.state == "failed":
                raise RuntimeError(f"rollout worker {client.address} failed: {stats.error}")

    def _train_step(self, batch: Batch):
        trajectories = batch.trajectories
        # Replayed samples weigh τ, then the batch is renormalised (paper §4.1), over
        # the whole step's batch before it is cut into micro-batches.
        weights = replay_sample_weights(
            torch.tensor([t.uses for t in trajectories], dtype=torch.long),
            torch.tensor([t.num_tokens for t in trajectories], dtype=torch.long),
            self.spec.replay.replay_weight).to(self.device)
        batch_tokens = float(sum(t.num_tokens for t in trajectories))
        plan = plan_micro_batches([len(t.prompt_ids) + len(t.response_ids) for t in trajectories],
                                  self.spec.trainer.max_tokens_per_micro_batch)
        self.optimizer.zero_grad(set_to_none=True)
        loss_total = 0.0
        stat_sums = {"clip_fraction": 0.0, "approx_kl": 0.0, "ratio_mean": 0.0}
        per_sample: dict[int, tuple[float, float]] = {}
        for indices in plan:
            tb = collate([trajectories[i] for i in indices], self.pad_id, self.device)
            logits = self.model(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits
            # The engine sampled from softmax(logits / T); score under the same law.
            logits = logits[:, :-1] / self.spec.rollout.temperature
            new_logprobs = token_logprobs(logits, tb.input_ids[:, 1:])
            loss, stats = grpo_token_loss(
                new_logprobs, tb.old_logprobs, tb.advantages, tb.loss_mask,
                self.spec.trainer.clip_eps, sample_weights=weights[indices],
                num_batch_tokens=batch_tokens)
            loss.backward()  # gradients accumulate: the sum is the whole batch's
            loss_total += stats.loss
            share = float(tb.loss_mask.sum()) / max(batch_tokens, 1.0)
            for name in stat_sums:
                stat_sums[name] += getattr(stats, name) * share
            with torch.no_grad():
                ratio = torch.exp((new_logprobs - tb.old_logprobs) * tb.loss_mask) * tb.loss_mask
                clipped = ((ratio - 1.0).abs() > self.spec.trainer.clip_eps) * tb.loss_mask
                denom = tb.loss_mask.sum(-1).clamp(min=1.0)
                for i, r, c in zip(indices, (ratio.sum(-1) / denom).tolist(),
                                   (clipped.sum(-1) / denom).tolist()):
                    per_sample[i] = (r, c)
        grad_norm = torch.nn.utils.clip_grad_norm_(
            self.model.parameters(), self.spec.trainer.max_grad_norm
        )
        self.optimizer.step()
        stats = LossStats(loss=loss_total, **stat_sums)
        sample_stats = {
            t.sample_id: {"ratio_mean": per_sample[i][0], "clip_fraction": per_sample[i][1],
                          "loss_weight": float(weights[i])}
            for i, t in enumerate(trajectories)
        }
        return (stats, float(grad_norm)), sample_stats

    def _publish(self) -> float:
        """Send the weights to every rollout worker as version v+1, then tell the buffer."""
        t0 = time.monotonic()
        version = self.policy_version + 1
        futures = [
            self._pool.submit(client.update_weights, self.job_id, version)
            for client in self.rollouts
        ]
        with torch.no_grad():
            send_weights(self._sync_group, self._named_weights())
        for f in futures:
            f.result()
        self.policy_version = version
        self.replay.publish_version(self.job_id, version)
        return time.monotonic() - t0

    def _rollout_totals(self) -> tuple[float, float, float, float]:
        """Idle seconds, occupancy seconds, generated tokens and finished samples,
        summed over the rollout workers."""
        stats = [c.stats(self.job_id) for c in self.rollouts]
        return (sum(s.idle_seconds_total for s in stats),
                sum(s.occupancy_seconds_total for s in stats),
                float(sum(s.generated_tokens_total for s in stats)),
                float(sum(s.finished_samples_total for s in stats)))

    def _metrics(self, batch: Batch, stats, wait_s: float, sync_s: float, step_s: float,
                 rollout_delta: list[float], wall_s: float) -> dict[str, Any]:
        loss_stats, grad_norm = stats
        rollout_idle_s, occupancy_s, generated_tokens, finished_samples = rollout_delta
        trajs = batch.trajectories
        trained_tokens = sum(t.num_tokens for t in trajs)
        # Staleness against the version the batch was leased (and trained) under,
        # from each sample's oldest segment: the policy lag the loss corrects for.
        staleness = [batch.policy_version - t.oldest_version for t in trajs]
        replayed = sum(1 for t in trajs if t.uses > 0)
        fresh = sum(1 for t, s in zip(trajs, staleness) if t.uses == 0 and s == 0)
        histogram: dict[str, int] = {}
        for s in staleness:
            histogram[str(s)] = histogram.get(str(s), 0) + 1
        buffer = self.replay.stats(self.job_id)
        num_workers = max(1, len(self.rollouts))
        startup: dict[str, float] = {}
        if self.step == 1:
            # Start-up, once, apart from the steady state: this trainer's model and
            # optimizer, and the slowest rollout engine's build.
            startup = {"trainer_startup_s": self.startup_s,
                       "engine_startup_s": max((c.stats(self.job_id).engine_startup_s
                                                for c in self.rollouts), default=0.0)}
        return {
            **startup,
            "step": self.step,
            "policy_version": self.policy_version,
            "reward_mean": sum(t.reward for t in trajs) / len(trajs),
            "trained_tokens": trained_tokens,
            "step_time_s": step_s,
            "trainer_tokens_per_s": trained_tokens / step_s if step_s > 0 else 0.0,
            "trainer_idle_ratio": min(1.0, wait_s / step_s) if step_s > 0 else 0.0,
            "rollout_idle_ratio": min(1.0, rollout_idle_s / (step_s * num_workers)) if step_s > 0 else 0.0,
            # The engines' measured batch occupancy over this step (running requests
            # over the concurrency cap), averaged over the workers.
            "rollout_utilisation": min(1.0, occupancy_s / (step_s * num_workers)) if step_s > 0 else 0.0,
            # Tokens the engines generated during this step (kept or not): generation
            # throughput, the adaptive scheduler's yardstick (paper §6.1).
            "generated_tokens": int(generated_tokens),
            # Samples the engines finished during this step: production, for placement.
            "generated_samples": int(finished_samples),
            "rollout_workers": num_workers,
            "generation_tokens_per_s": generated_tokens / step_s if step_s > 0 else 0.0,
            "fresh_samples": fresh,
            "stale_samples": len(trajs) - fresh - replayed,
            "replay_samples": replayed,
            "replay_fraction": replayed / len(trajs),
            "max_staleness": max(staleness),
            "staleness_counts": histogram,
            "wall_time_s": wall_s,
            "batch_wait_s": wait_s,
            "weight_sync_s": sync_s,
            "unused_pool_samples": buffer.unused_samples,
            "replay_pool_samples": buffer.replay_samples,
            "evicted_samples_total": buffer.evicted_total,
            "evicted_unused_samples_total": buffer.evicted_unused_total,
            "dispatched_samples_total": buffer.dispatched_total,
            "trained_unused_samples_total": buffer.trained_unused_total,
            "filter_dropped_samples_total": buffer.dropped_total,
            "outstanding_leases": buffer.outstanding_leases,
            "loss": loss_stats.loss,
            "clip_fraction": loss_stats.clip_fraction,
            "approx_kl": loss_stats.approx_kl,
            "grad_norm": grad_norm,
            "response_len_mean": sum(len(t.response_ids) for t in trajs) / len(trajs),
        }

    @property
    def last_metrics(self) -> dict[str, Any]:
        return self.recent_metrics[-1] if self.recent_metrics else {}

    def _emit(self, record: dict[str, Any]) -> None:
        self.recent_metrics.append(record)
        logger.info(
            "job %s step %d v%d reward %.3f tokens/s %.0f idle %.2f",
            self.job_id, record["step"], record["policy_version"], record["reward_mean"],
            record["trainer_tokens_per_s"], record["trainer_idle_ratio"],
        )
        if self.metrics is not None:
            self.metrics.observe(self.job_id, record)
        if self.run_dir is not None:
            with open(self.run_dir / "metrics.jsonl", "a") as f:
                f.write(json.dumps(record) + "\n")

    def save(self, path: Path) -> None:
        self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
