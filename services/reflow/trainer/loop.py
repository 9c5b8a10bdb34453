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
import copy
import dataclasses
import json
import logging
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from reflow.core.config import JobSpec
from reflow.core.errors import ConsecutiveFailures
from reflow.core.types import Batch
from reflow.models.tokens import stop_token_ids
from reflow.replay.client import ReplayClient
from reflow.trainer.checkpoint import (CheckpointInfo, Checkpointer, load_checkpoint,
                                       supersede_metrics)
from reflow.trainer.dp import GroupBroken, TrainerGroup
from reflow.trainer.evaluation import PeriodicEval
from reflow.trainer.fsdp import gather_full_state, policy_parameters, wants_fsdp
from reflow.trainer.handoff import SharedState
from reflow.trainer.lora import apply_lora, export_lora, synced_parameters
from reflow.trainer.membership import GroupMembership
from reflow.trainer.publish import WeightPublisher
from reflow.trainer.records import step_record
from reflow.trainer.schedule import set_learning_rate
from reflow.trainer.snapshots import snapshot_fields
from reflow.trainer.sync_check import probe_token_ids
from reflow.trainer.step import collate, compute_step, plan_micro_batches  # noqa: F401 - re-exported
from reflow.tracking import open_trackers

RECENT_METRICS_STEPS = 4096
# An engine's stats may fail this many polls in a row (each after the channel's
# own retries) before the job fails for it: a restart is ridden out, a dead
# engine is not waited on forever.
MAX_STATS_FAILURES = 5
# How long the last step's record waits for the final evaluation.
EVAL_FINAL_WAIT_S = 900.0

logger = logging.getLogger(__name__)


class JobStopped(Exception):
    """The job was asked to stop."""


class TrainLoop(GroupMembership, WeightPublisher):
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
        trainer_client_factory: Any = None,
        resume_from: CheckpointInfo | None = None,
    ) -> None:
        """`replay` None: a replica of the trainer group (trainer/replica.py), which
        never talks to the buffer. `trainer_client_factory(address)`: how the leader
        reaches its replicas (GrpcTrainerClient by default). `resume_from`: a
        committed checkpoint (trainer/checkpoint.py) to continue from."""
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
        # The learning rate the last step trained at (trainer/schedule.py).
        self.learning_rate = spec.trainer.learning_rate
        # The frozen initial model of the KL penalty (trainer.kl_coef > 0), and the
        # bytes its parameters hold; built by load().
        self.reference: torch.nn.Module | None = None
        self.stop_ids: list[int] | None = None
        self.reference_bytes = 0
        # Recent per-step records for the scheduler, which polls about once a second
        # and copies them into the job store; bounded so a lost poller costs no memory.
        self.recent_metrics: deque[dict[str, Any]] = deque(maxlen=RECENT_METRICS_STEPS)
        self._stop = threading.Event()
        # Per rollout engine: its stats polls' transient failures in a row.
        self._stats_polls: dict[str, ConsecutiveFailures] = {}
        self._sync_group = None
        # One thread per rollout worker's update call, and one for the broadcast.
        self._pool = ThreadPoolExecutor(max_workers=len(rollouts) + 1, thread_name_prefix="wsync")
        # The data-parallel trainer group (trainer/dp.py): None while this trainer
        # trains alone. Membership changes wait for a step boundary.
        self.group: TrainerGroup | None = None
        self.peers: list[str] = []
        self.membership_epoch = 0
        self.last_regroup_s = 0.0
        self._pending_peers: list[str] | None = None
        self._membership_lock = threading.Lock()
        # Wakes a boundary waiting for a scripted flip (membership.py).
        self._membership_changed = threading.Condition(self._membership_lock)
        self.scripted_flips_seen = 0
        # Times the group broke by a member's loss (trainer/membership.py).
        self.group_failures = 0
        # When each break and counted rebuild happened (core/restart_budget.py's window).
        self.group_failure_times: list[float] = []
        self.weight_sync_rebuild_times: list[float] = []
        # The engines the scheduler set and their client factory, not yet applied.
        self._pending_engines: tuple[list[str], object] | None = None
        self.retired_engines: list[str] = []
        self._engines_changed = False
        self._trainer_client_factory = trainer_client_factory
        # The leader's state in same-host shared memory (trainer/handoff.py), while
        # this job may have replicas.
        self.shared_state: SharedState | None = None
        self.last_handoff = ""
        # Evaluations on the held-out split, beside training (trainer/evaluation.py).
        self.evals = PeriodicEval(job_id, spec, rollouts if replay is not None else [])
        # Checkpoints at the trained point, by the leader (replicas hold the same state).
        self.resume_from = resume_from
        self.checkpointer: Checkpointer | None = None
        if self.run_dir is not None and replay is not None:
            self.checkpointer = Checkpointer(
                self.run_dir, spec.trainer.checkpoint_interval, spec.trainer.checkpoint_keep_last,
                observe=(lambda *m: metrics.observe_checkpoint(job_id, *m))
                if metrics is not None and hasattr(metrics, "observe_checkpoint") else None,
                resumed_step=resume_from.step if resume_from is not None else 0)
        # Records of the steps after the checkpoint resumed from (trained again here).
        self.superseded_steps = 0
        self._mid_step = False
        # Weight-sync groups rebuilt after a rollout worker was replaced (publish.py).
        self.weight_sync_rebuilds = 0
        # The probe's log-probabilities under the last published policy, and the
        # largest mean difference an engine showed at the last check (sync_check.py).
        self._probe_expected: list[float] | None = None
        self.last_sync_check = 0.0
        # The last version's check, running beside training (publish.py), on threads
        # of its own: it waits on the engines, never on the weight-sync threads.
        self._engine_check: Future | None = None
        self._check_pool = ThreadPoolExecutor(max_workers=len(rollouts) + 1,
                                              thread_name_prefix="sync-check")
        self.sync_bytes = 0
        # trainer.parallelism resolved at load(); with fsdp, the FSDP root over the
        # model once the group is formed (trainer/fsdp.py), and the whole weights
        # gathered to the leader at the end, for the final export.
        self.sharded = False
        self.root: torch.nn.Module | None = None
        self._final_state: dict[str, torch.Tensor] | None = None
        # Experiment trackers (reflow.tracking), fed from a background thread; only
        # the trainer that writes metrics.jsonl (never a replica) logs.
        self.tracking = open_trackers(
            job_id, spec, self.run_dir if replay is not None else None,
            on_error=getattr(metrics, "tracker_error", None),
            on_drop=getattr(metrics, "tracker_drop", None))

    def stop(self) -> None:
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

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
        # The KL penalty's reference is the job's initial weights, frozen: a copy
        # taken before the first step (every rank of the group takes the same one).
        self.reference, self.reference_bytes = None, 0
        if self.spec.trainer.kl_coef > 0.0:
            self.reference = copy.deepcopy(self.model).eval().requires_grad_(False)
            self.reference_bytes = sum(p.numel() * p.element_size()
                                       for p in self.reference.parameters())
            logger.info("job %s: reference model for trainer.kl_coef=%g holds %d bytes",
                        self.job_id, self.spec.trainer.kl_coef, self.reference_bytes)
        # Adapters go on after the reference copy, which stays the base model.
        self.peft_model = (apply_lora(self.model, self.spec.lora)
                           if self.spec.lora is not None else None)
        if self.spec.trainer.activation_checkpointing:
            self.model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        self.model.train()
        self.optimizer = self._new_optimizer(self.model.parameters())
        # The sequence the engines' weights are checked on after each sync (sync_check.py).
        self.probe_ids = probe_token_ids(len(self.tokenizer))
        self.pad_id = self.tokenizer.pad_token_id or 0
        # The stop tokens the engine masks under a curriculum's min_tokens, which the
        # trainer masks too where it scores those positions (models/tokens.py).
        self.stop_ids = (stop_token_ids(path) if any(
            stage.min_tokens for stage in self.spec.rollout.length_schedule) else None)
        self.sharded = wants_fsdp(self.spec, sum(p.numel() for p in self.model.parameters()))
        if self.resume_from is not None:
            # After the reference copy: the KL penalty stays against the job's initial
            # weights, whatever checkpoint training continues from. Sharded, every
            # rank loads its shards once the group is formed (membership.py).
            if not self.sharded:
                load_checkpoint(self.resume_from, self.model, self.optimizer)
            self.step, self.policy_version = self.resume_from.step, self.resume_from.policy_version
            if self.run_dir is not None:
                # Records of the steps after the checkpoint describe weights that are
                # gone; those steps run again, so each step has one record.
                self.superseded_steps = supersede_metrics(self.run_dir, self.step)
            logger.info("job %s: resumed from %s (step %d, policy version %d)", self.job_id,
                        self.resume_from.path, self.step, self.policy_version)
        # Start-up (model and optimizer built), reported with the first step.
        self.startup_s = time.monotonic() - started
        # The buffer composes batches and evicts by these settings (σ, δ, plug-ins).
        if self.replay is not None:
            self.replay.configure(self.job_id, self.spec.replay)

    def _new_optimizer(self, parameters) -> torch.optim.Optimizer:
        # With LoRA only the adapters train: AdamW holds no state for the base weights.
        parameters = [p for p in parameters if p.requires_grad]
        return torch.optim.AdamW(parameters, lr=self.spec.trainer.learning_rate,
                                 weight_decay=self.spec.trainer.weight_decay)

    @property
    def trained(self) -> torch.nn.Module:
        """What compute_step trains: the FSDP root when sharded, else the model."""
        return self.root if self.root is not None else self.model

    def _named_weights(self) -> list[tuple[str, torch.Tensor]]:
        # The whole weights, or with LoRA the adapters alone (lora.synced_parameters);
        # fsdp.policy_parameters keeps the same names and order, each a DTensor of
        # global shape.
        if self.root is not None:
            return policy_parameters(self.root)
        return synced_parameters(self.model)

    # --- the loop -----------------------------------------------------------------

    def share_state(self) -> None:
        """Move this leader's state into same-host shared memory (handoff.py), so a
        replica joining on this host copies it instead of receiving a broadcast:
        for an elastic job on CPU with `cluster.state_handoff: auto`."""
        cluster = self.spec.cluster
        if self.sharded and cluster.workers is not None and cluster.state_handoff == "auto":
            # FSDP keeps its shards in storage of its own, so a same-host file would
            # hold a copy made at each flip: measured on SmolLM2-135M (770 MB to a
            # joiner), that copy and the reader's made the move 2.2 s against 1.5 s
            # point to point over loopback gloo. So shards always move over the group.
            logger.info("job %s: fsdp: shards move point to point over the group; the "
                        "same-host shared-memory hand-off is for replicated groups", self.job_id)
        if (self.shared_state is None and cluster.workers is not None and not self.sharded
                and cluster.state_handoff == "auto" and self.device.type == "cpu"):
            try:
                self.shared_state = SharedState.share(self.model, self.optimizer)
            except OSError as err:  # no memfd here: joiners receive the broadcast
                logger.warning("job %s: trainer state stays private (%s)", self.job_id, err)

    def unshare_state(self) -> None:
        if self.shared_state is not None:
            self.shared_state.close(self.model, self.optimizer)
            self.shared_state = None

    def run(self) -> None:
        self.share_state()
        try:
            self._run()
        finally:
            self.unshare_state()

    def _run(self) -> None:
        start = time.monotonic()
        if self.sharded:
            with self._membership_lock:
                if self._pending_peers is None and self.root is None:
                    # Alone too: an FSDP leader shards before its first step, so a
                    # later joiner receives trained shards from it (reshard.py), never
                    # shards the weights it loaded itself.
                    self._pending_peers = []
        self.apply_membership()  # the replicas the job starts with
        self._resync_engines()
        self.check_engines_at_start()
        rollout_before = self._rollout_totals()
        # A step's time runs from the previous step's end to this one's, so the work
        # between steps (metrics, stats calls) counts against throughput too.
        previous_end = time.monotonic()
        checkpoint_s = 0.0  # the staging of the save the previous step started
        self.evals.maybe_start(self.policy_version)  # the initial weights, as a baseline
        while self.step < self.spec.trainer.num_steps:
            if self._stop.is_set():
                raise JobStopped()
            self._apply_engines()
            step_start = time.monotonic()
            # 1. Wait for a batch; the wait is the trainer's idle time.
            batch = self._lease_batch()
            wait_s = time.monotonic() - step_start
            released = False
            try:
                # 2. Optimise, renewing the lease meanwhile: a step longer than the lease
                #    must not see its samples handed back and trained again as fresh.
                train_start = time.monotonic()
                # From the optimizer step until the step's record is out, the state is
                # between steps (ahead of the buffer, or of the curve): no stop
                # checkpoint then; the last committed one stays the one to resume.
                self._mid_step = True
                with self._lease_kept(batch):
                    stats, sample_stats = self._train_step(batch)
                train_s = time.monotonic() - train_start
                # 3. Release: the samples are trained; the buffer's replay filter sees
                #    each one's training stats and decides whether it comes back.
                self.replay.release(self.job_id, batch.lease_id, sample_stats)
                released = True
            finally:
                if not released:
                    self._give_back(batch)
            self.step += 1
            # 4. Publish a new policy version every sync_interval steps.
            sync_s = sync_wait_s = 0.0
            if self.step % self.spec.trainer.sync_interval == 0:
                sync_s, sync_wait_s = self._publish_or_rebuild()
                self.evals.maybe_start(self.policy_version)
                # Roles move at sync boundaries only (paper §5); a flip the spec
                # scripts for this step is waited for, so it lands here.
                if self.step < self.spec.trainer.num_steps:
                    sync_wait_s += self.await_scripted_flips()
                self.apply_membership()
            step_end = time.monotonic()
            step_s, previous_end = step_end - previous_end, step_end
            rollout_now = self._rollout_totals()
            record = step_record(self, batch, stats, wait_s, train_s, sync_s, sync_wait_s, step_s,
                                   self._rollout_delta(rollout_before, rollout_now),
                                   time.monotonic() - start)
            rollout_before = rollout_now
            record.update(snapshot_fields(self))  # trainer.policy_snapshot_interval
            # The last record waits for the final version's evaluation: training is over.
            last = self.step == self.spec.trainer.num_steps
            record.update(self.evals.take(wait_s=EVAL_FINAL_WAIT_S if last else 0.0))
            if self.checkpointer is not None:
                # The staging of the save the previous step started (its write runs
                # beside training); the last committed save's size and times.
                record["checkpoint_s"] = checkpoint_s
                record["last_checkpoint_step"] = self.checkpointer.last_committed_step
                record.update(self.checkpointer.last)
            if self.resume_from is not None and self.step == self.resume_from.step + 1:
                # Once, on the first step after a resume: where from, and what it cost.
                record["resumed_from_step"] = self.resume_from.step
                record["superseded_steps"] = self.superseded_steps
            self._emit(record)
            if self.tracking is not None:
                self.tracking.log_generations(self.step, batch.trajectories, self.tokenizer)
            self._mid_step = False
            # After the step's record: a checkpoint of step N always has N's record.
            checkpoint_s = 0.0
            if self.checkpointer is not None and self.checkpointer.due(self.step):
                checkpoint_s = self.checkpoint()
        # The last version's sync check: a job whose engines ended on other weights fails.
        self.finish_engine_check()
        if self.root is not None:
            # The final export's whole weights, gathered to this leader by every rank.
            self.group.send_command("export", self.step)
            self._final_state = gather_full_state(self.root)
        if self.group is not None:
            try:
                self.group.send_command("stop", self.step)
            except GroupBroken as err:  # the training is done; a lost replica changes nothing
                logger.warning("job %s: stop to a broken group: %s", self.job_id, err)

    def checkpoint(self) -> float:
        """Save a checkpoint of this step in the background, with the buffer's
        ledger as of now (this step's lease released); returns the seconds the step
        spent on it."""
        try:
            ledger = dataclasses.asdict(self.replay.stats(self.job_id))
        except Exception as err:  # noqa: BLE001 - the weights are worth saving without it
            logger.warning("job %s: checkpoint without the buffer's ledger: %s", self.job_id, err)
            ledger = {"error": f"{type(err).__name__}: {err}"[:500]}
        extra = {"job_id": self.job_id, "ledger": ledger}
        if self.root is not None:
            # Every rank writes its shards (a collective); the leader commits.
            path = self.checkpointer.prepare(self.step)
            self.group.send_command("checkpoint", self.step, arg=str(path))
            return self.checkpointer.save_sharded(path, self.step, self.policy_version,
                                                  self.root, self.optimizer, extra)
        return self.checkpointer.save(self.step, self.policy_version, self.model,
                                      self.optimizer, extra)

    def checkpoint_on_stop(self, timeout_s: float = 600.0) -> None:
        """A graceful stop saves the step it stopped at (unless that step is saved
        already) and waits for the save to commit."""
        cp = self.checkpointer
        if cp is None or self.step == 0:
            return
        if self.root is not None:
            # A stop reaches the replicas too: they may be gone before a save they
            # would have to write with this leader.
            logger.info("job %s: fsdp: the last committed checkpoint (step %d) stays the "
                        "one to resume from", self.job_id, cp.last_committed_step)
            cp.wait(timeout_s)
            return
        if self._mid_step:
            # Stopped between an optimizer step and its record: the weights are not
            # those of a whole step the buffer and the curve both know.
            logger.warning("job %s: stopped mid-step; the last committed checkpoint (step %d) "
                           "stays the one to resume from", self.job_id, cp.last_committed_step)
            cp.wait(timeout_s)
            return
        if self.step > max(cp.last_committed_step, self.resumed_step):
            self.checkpoint()
        cp.wait(timeout_s)

    @property
    def resumed_step(self) -> int:
        return self.resume_from.step if self.resume_from is not None else 0

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
            self._apply_engines()
            self._check_rollouts()
            self.resync_replaced_engines()
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

    def _rollout_stats(self, client):
        """`client.stats`, or None after a transient failure (logged; the next poll
        tries again); raises once one engine has failed MAX_STATS_FAILURES in a row."""
        polls = self._stats_polls.get(client.address)
        if polls is None:
            polls = self._stats_polls[client.address] = ConsecutiveFailures(
                f"job {self.job_id}: stats of rollout worker {client.address}",
                MAX_STATS_FAILURES)
        return polls.call(client.stats, self.job_id)

    def _check_rollouts(self) -> None:
        for client in self.rollouts:
            stats = self._rollout_stats(client)
            if stats is not None and stats.state == "failed":
                raise RuntimeError(f"rollout worker {client.address} failed: {stats.error}")

    def _train_step(self, batch: Batch):
        while True:
            group = self.group
            try:
                if group is not None:
                    # The replicas compute their shares of the same batch (trainer/dp.py).
                    group.send_command("train", self.step + 1, batch.trajectories)
                # From the step number, as every replica sets it: nothing of the
                # schedule needs saving or handing over (trainer/schedule.py).
                self.learning_rate = set_learning_rate(self.optimizer, self.spec.trainer,
                                                       self.step + 1)
                return compute_step(self.trained, self.optimizer, self.spec, batch.trajectories,
                                    self.pad_id, self.device, group, reference=self.reference,
                                    step=self.step + 1, stop_ids=self.stop_ids)
            except GroupBroken as err:
                # No rank stepped: the same batch again, on the group that is left.
                self._regroup_after(err)

    def _rollout_totals(self) -> dict[str, tuple[bool, tuple[float, ...]]]:
        """Per rollout engine: whether it generates now (an engine of a worker in the
        trainer role stands by), and its idle seconds, occupancy seconds, generated
        tokens, finished samples, engine-busy seconds, engine decode steps and groups
        dynamic sampling dropped so far.
        An engine whose stats could not be read
        now is left out (of this step's rollout metrics, and of the next one's)."""
        out = {}
        for c in self.rollouts:
            s = self._rollout_stats(c)
            if s is None:
                continue
            out[c.address] = (s.state != "standby",
                              (s.idle_seconds_total, s.occupancy_seconds_total,
                               float(s.generated_tokens_total), float(s.finished_samples_total),
                               s.engine_busy_seconds_total, float(s.engine_decode_steps_total),
                               float(s.filtered_groups_total)))
        return out

    @staticmethod
    def _rollout_delta(before: dict, now: dict) -> list[float]:
        """The step's idle, occupancy, tokens, samples, engine-busy seconds, decode
        steps and filtered groups over the engines generating now, and their number."""
        active = [(totals, before.get(address, (True, totals))[1])
                  for address, (generating, totals) in now.items() if generating]
        # A replaced worker's counters start again from zero: its totals are all
        # this step's.
        active = [(t, b if all(x >= y for x, y in zip(t, b)) else (0.0,) * len(t))
                  for t, b in active]
        sums = [sum(t[k] - b[k] for t, b in active) for k in range(7)]
        return [*sums, float(len(active))]

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
        if self.tracking is not None:
            self.tracking.log_record(record)

    def save(self, path: Path) -> None:
        if self.spec.lora is not None:
            export_lora(self.model, self.tokenizer, path, self.spec.lora,
                        full_state=self._final_state, base_model_path=self.spec.model.path)
            return
        if self.root is not None:
            self.model.save_pretrained(path, state_dict=self._final_state,
                                       safe_serialization=True)
        else:
            self.model.save_pretrained(path, safe_serialization=True)
        self.tokenizer.save_pretrained(path)

    def close_tracking(self) -> None:
        """Flush and close the trackers (waiting tracking.close_timeout_s at most).
        Before the job reports its end: the scheduler then stops this process and
        every process it started, a tracker's own (W&B's service) among them."""
        if self.tracking is not None:
            self.tracking.close()

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._check_pool.shutdown(wait=False, cancel_futures=True)
        self.evals.close()
        self.close_tracking()
        if self.root is not None and self.group is not None:
            self.group.close()  # this process's default group: the next job may need it
