"""The trainer service's core: runs one job's `TrainLoop` on a thread and
reports its state. Transport lives in `server.py`."""

from __future__ import annotations

import logging
import os
import threading
from pathlib import Path

from reflow.core.config import JobSpec, check_job_id
from reflow.core.errors import FailedPrecondition
from reflow.core.paths import check_address
from reflow.core.paths import PathRoots
from reflow.replay.client import GrpcReplayClient
from reflow.rollout.client import GrpcRolloutClient
from reflow.trainer.loop import JobStopped, TrainLoop

# How long a shutdown lets the step in progress finish before it cuts the buffer's
# retries short.
SHUTDOWN_STEP_WAIT_S = 10.0

# A replica's states that end its part in a job.
TERMINAL = ("succeeded", "failed", "stopped")

logger = logging.getLogger(__name__)

# Rollout workers one trainer broadcasts weights to (its weight-sync group less itself).
MAX_ROLLOUT_WORKERS = 4095
# cluster.flips holds at most this many (core/pool_config.py).
MAX_SCRIPTED_FLIPS = 10_000


class TrainerService:
    def __init__(self, replay_client_factory=GrpcReplayClient,
                 rollout_client_factory=GrpcRolloutClient, metrics=None,
                 roots: PathRoots | None = None) -> None:
        self.metrics = metrics
        self.roots = roots or PathRoots.from_env()
        self._replay_client_factory = replay_client_factory
        self._rollout_client_factory = rollout_client_factory
        self._lock = threading.Lock()
        self.job_id = ""
        self.state = "idle"
        self.error = ""
        self.loop: TrainLoop | None = None
        self.replica = None  # TrainerReplica, for an elastic job led elsewhere
        self._thread: threading.Thread | None = None

    def start_job(self, job_id: str, spec: JobSpec, replay_address: str,
                  rollout_addresses: list[str], run_dir: str,
                  trainer_peers: list[str] | None = None, leader_host: str = "",
                  resume_from: str = "") -> None:
        """Run a job's training loop here; with `leader_host`, only load a warm
        replica of the job's trainer group (trainer/replica.py), to be joined into
        the group of the leader on that host. `trainer_peers`: the replicas the
        leader's group starts with. `resume_from`: a committed checkpoint of this
        run (a directory under `<run_dir>/checkpoints`) to continue from."""
        check_job_id(job_id)
        if leader_host:
            return self._start_replica(job_id, spec, leader_host)
        peers = [check_address(a, "trainer_peers") for a in trainer_peers or []]
        if len(peers) >= MAX_ROLLOUT_WORKERS:
            raise ValueError(f"trainer_peers: {len(peers)} given; at most "
                             f"{MAX_ROLLOUT_WORKERS - 1}")
        if not 1 <= len(rollout_addresses) <= MAX_ROLLOUT_WORKERS:
            raise ValueError(f"rollout_addresses: {len(rollout_addresses)} given; a job has 1 to "
                             f"{MAX_ROLLOUT_WORKERS} rollout workers")
        # Paths from the request resolve under this process's roots, or are refused.
        spec = self._confined(spec)
        run_dir = str(self.roots.run_dir(run_dir)) if run_dir else ""
        resume = self._checkpoint(run_dir, resume_from) if resume_from else None
        with self._lock:
            if self.state in ("starting", "running"):
                if self.job_id == job_id:
                    return
                raise FailedPrecondition(f"this trainer already runs job {self.job_id}")
            self.job_id, self.state, self.error = job_id, "starting", ""
            replay = self._replay_client_factory(replay_address)
            rollouts = [self._rollout_client_factory(a) for a in rollout_addresses]
            self.loop = TrainLoop(
                job_id, spec, replay, rollouts, run_dir=run_dir or None,
                master_address=os.environ.get("REFLOW_POD_IP", "127.0.0.1"),
                metrics=self.metrics, resume_from=resume,
            )
            if peers:
                self.loop.reconfigure(peers)
            self._thread = threading.Thread(target=self._run, name="train-loop", daemon=True)
            self._thread.start()

    def _start_replica(self, job_id: str, spec: JobSpec, leader_host: str) -> None:
        if len(leader_host) > 253 or not leader_host.strip():
            raise ValueError("leader_host: the trainer leader's host (at most 253 characters)")
        spec = self._confined(spec)
        with self._lock:
            if self.replica is not None and self.replica.job_id == job_id:
                return  # a retried start
            if self.state in ("starting", "running") or (
                    self.replica is not None and self.replica.state not in TERMINAL):
                raise FailedPrecondition(f"this trainer already serves job {self.job_id}")
            from reflow.trainer.replica import TrainerReplica

            self.job_id, self.state, self.error = job_id, "replica", ""
            self.replica = TrainerReplica(job_id, spec, leader_host)
            threading.Thread(target=self._load_replica, args=(self.replica,),
                             name="replica-load", daemon=True).start()

    @staticmethod
    def _load_replica(replica) -> None:
        from reflow.models.tiny import ensure_model

        spec = replica.loop.spec
        ensure_model(spec.model.path, spec.model.build_if_missing, seed=spec.seed)
        replica.load()

    @staticmethod
    def _checkpoint(run_dir: str, resume_from: str):
        """The checkpoint to resume from: committed, and inside this run's
        checkpoints directory (ValueError naming the field otherwise)."""
        from reflow.core.paths import confine
        from reflow.trainer.checkpoint import CHECKPOINTS_DIR, read_checkpoint

        if not run_dir:
            raise ValueError("resume_from: needs the job's run_dir, where its checkpoints are")
        root = Path(run_dir) / CHECKPOINTS_DIR
        return read_checkpoint(confine(root / resume_from, root, "resume_from"))

    def _confined(self, spec: JobSpec) -> JobSpec:
        """The spec with its model path resolved under this process's models root."""
        model_path = self.roots.model_dir(spec.model.path)
        return spec.model_copy(update={"model": spec.model.model_copy(
            update={"path": str(model_path)})})

    def join_group(self, job_id: str, master_port: int, rank: int, world_size: int,
                   epoch: int, rendezvous_key: str) -> None:
        """Replica: join the leader's group (on the leader host fixed at start) under
        the rendezvous key the leader drew for it."""
        self._replica_for(job_id).join(master_port, rank, world_size, epoch, rendezvous_key)

    def leave_group(self, job_id: str, epoch: int) -> None:
        """Replica: the leader gave up the group of `epoch` (a rank of it was lost)."""
        self._replica_for(job_id).leave(epoch)

    def reconfigure(self, job_id: str, peers: list[str] | None,
                    rollout_addresses: list[str] | None = None, scripted_flips: int = 0) -> int:
        """Leader: the group's next replicas (None: unchanged), applied at the next
        sync boundary; `rollout_addresses` (non-empty): the engines still in the
        job; `scripted_flips`: the spec's flips the scheduler has dealt with."""
        if peers is not None:
            peers = [check_address(a, "trainer_peers") for a in peers]
        if not 0 <= scripted_flips <= MAX_SCRIPTED_FLIPS:
            raise ValueError(f"scripted_flips: {scripted_flips} is not in "
                             f"[0, {MAX_SCRIPTED_FLIPS}] (the spec's cluster.flips at most)")
        engines = [check_address(a, "rollout_addresses") for a in rollout_addresses or []]
        if peers is not None and len(peers) >= MAX_ROLLOUT_WORKERS:
            raise ValueError(f"trainer_peers: at most {MAX_ROLLOUT_WORKERS - 1}")
        if job_id != self.job_id or self.loop is None or self.state not in ("starting",
                                                                            "running"):
            raise FailedPrecondition(f"job {job_id[:80]!r} is not training on this trainer")
        if engines:
            self.loop.set_engines(engines, self._rollout_client_factory)
        return self.loop.reconfigure(peers, scripted_flips)

    def _replica_for(self, job_id: str):
        if self.replica is None or self.replica.job_id != job_id:
            raise FailedPrecondition(f"job {job_id[:80]!r} has no replica on this trainer")
        return self.replica

    def _run(self) -> None:
        loop = self.loop
        if loop is None:
            raise RuntimeError("trainer: _run started before start_job created the loop")
        try:
            from reflow.models.tiny import ensure_model

            ensure_model(loop.spec.model.path, loop.spec.model.build_if_missing, seed=loop.spec.seed)
            loop.load()
            loop.init_weight_sync()
            self.state = "running"
            loop.run()
            if loop.checkpointer is not None:
                loop.checkpointer.wait()
            if loop.run_dir is not None:
                loop.save(Path(loop.run_dir) / "checkpoint")
            # The trackers' last records are out before the end is reported: the
            # scheduler then takes down this process's tree (reflow.tracking).
            loop.close_tracking()
            self.state = "succeeded"
        except JobStopped:
            # A graceful stop (a request, or SIGTERM) keeps the step it reached.
            self._checkpoint_on_stop(loop)
            loop.close_tracking()
            self.state = "stopped"
        except Exception as err:  # noqa: BLE001 - reported through GetStatus
            if loop.stopping:
                # Asked to stop while the job's other services go away too: what
                # failed is their absence; the step reached is still kept.
                logger.warning("job %s: stopped (%s: %s)", self.job_id, type(err).__name__, err)
                self._checkpoint_on_stop(loop)
                loop.close_tracking()
                self.state = "stopped"
            else:
                logger.exception("job %s: training failed", self.job_id)
                loop.close_tracking()
                self.state, self.error = "failed", f"{type(err).__name__}: {err}"
        finally:
            loop.close()

    def _checkpoint_on_stop(self, loop: TrainLoop) -> None:
        try:
            loop.checkpoint_on_stop()
        except Exception:  # noqa: BLE001 - the job still stops; the last checkpoint stays
            logger.exception("job %s: no checkpoint at the stop", self.job_id)

    def stop_job(self, job_id: str) -> None:
        if self.replica is not None and self.replica.job_id == job_id:
            self.replica.stop()
            return
        if job_id != self.job_id or self.loop is None:
            raise KeyError(f"job {job_id!r} does not run on this trainer")
        self.loop.stop()
        if self._thread is not None:
            self._thread.join(30)

    def shutdown(self, timeout_s: float = 120.0) -> None:
        """The process is going away: stop the running job, which checkpoints the
        step it reached (TrainLoop.checkpoint_on_stop), and wait for that."""
        loop, thread = self.loop, self._thread
        if loop is None or thread is None or not thread.is_alive():
            return
        logger.info("job %s: stopping for shutdown", self.job_id)
        loop.stop()
        thread.join(SHUTDOWN_STEP_WAIT_S)
        if thread.is_alive() and loop.replay is not None:
            # Still in a call to the buffer, retrying: when the whole job goes down the
            # buffer is gone too. Cut the retry short; the stop checkpoint goes on
            # without the buffer's ledger (TrainLoop.checkpoint).
            loop.replay.close()
        thread.join(timeout_s)

    def status(self, job_id: str, since_step: int = -1) -> dict:
        """State and progress; with since_step >= 0 also the metrics records of the
        steps after it that are still in the trainer's window."""
        if job_id and job_id != self.job_id:
            raise KeyError(f"job {job_id!r} does not run on this trainer")
        replica = self.replica
        if replica is not None and replica.job_id == self.job_id:
            return {"job_id": self.job_id, "state": replica.state, "step": replica.step,
                    "policy_version": 0, "last_metrics": {}, "error": replica.error,
                    "metrics": [], "group_size": 0, "membership_epoch": replica.epoch,
                    "last_regroup_s": 0.0, "last_state_handoff": ""}
        loop = self.loop
        return {
            "group_size": loop.group_size if loop else 1,
            "membership_epoch": loop.membership_epoch if loop else 0,
            "last_regroup_s": loop.last_regroup_s if loop else 0.0,
            "last_state_handoff": loop.last_handoff if loop else "",
            "job_id": self.job_id,
            "state": self.state,
            "step": loop.step if loop else 0,
            "policy_version": loop.policy_version if loop else 0,
            "last_metrics": loop.last_metrics if loop else {},
            "error": self.error,
            "metrics": ([r for r in list(loop.recent_metrics) if r["step"] > since_step]
                        if loop and since_step >= 0 else []),
        }
