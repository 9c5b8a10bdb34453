"""The scheduler's core: job lifecycles.

A submitted job is recorded PENDING, placed by the cluster backend in
submission order (scheduler/jobcontrol/queue.py; it stays PENDING, its reason saying why,
while the backend has no free workers), started on its services (rollout first,
so the engine warms while the trainer loads), then watched: progress comes from
the trainer's status, failures from any service process exiting or reporting an
error, which the job's controller recovers from where it can
(scheduler/jobcontrol/controller.py). At the end the replay buffer is told the job ended
(its passes are taken there no more), its services are torn down and the record
gets its terminal phase and reason. A scheduler that shuts down hands its jobs
over to the next one; what that one does with them is scheduler/jobcontrol/recovery.py.
"""

from __future__ import annotations

import logging
import re
import threading
import time
import uuid
from pathlib import Path

from reflow.core.config import JobSpec, check_job_id
from reflow.core.errors import (ConsecutiveFailures, Conflict, FailedPrecondition, NoCapacity,
                                ResourceExhausted, Unavailable)
from reflow.core.limits import OperatorLimits
from reflow.core.paths import PathRoots
from reflow.replay.client import GrpcReplayClient
from reflow.rollout.client import GrpcRolloutClient
from reflow.tasks import build_task, check_task
from reflow.core.errors import PermanentError
from reflow.scheduler.jobcontrol.controller import JobController
from reflow.scheduler.generation.dispatch import Dispatcher
from reflow.scheduler.generation.inflight import DispatchLedger
from reflow.scheduler.placement.elastic import ElasticPool
from reflow.scheduler.placement.feed import PlacementFeed, planner_for
from reflow.scheduler.jobcontrol.jobs import LOG_SERVICES, JobRecord, JobStore
from reflow.scheduler.cluster.local import Placement, ServiceLog
from reflow.scheduler.jobcontrol.queue import PlacementQueue
from reflow.scheduler.jobcontrol.recovery import JobRecovery
from reflow.scheduler.jobcontrol.resize import RolloutResizer
from reflow.trainer.client import GrpcTrainerClient
from reflow.weightsync import RankPlan

logger = logging.getLogger(__name__)

POLL_INTERVAL_S = 1.0
# Polls of a job's rollout workers or trainer that may fail in a row (each after
# the channel's retries) before the job fails: a restart is ridden out.
MAX_POLL_FAILURES = 10
# How often the job at the head of the queue tries again when no release woke it.
QUEUE_RETRY_S = 5.0
# How long a shutdown waits for each job's thread (a handover's stop checkpoint and
# orderly teardown included).
SHUTDOWN_JOIN_S = 120.0
MAX_LOG_TAIL_BYTES = 8 * 1024 * 1024
# How long a job's end waits for the replay buffer's EndJob, retries included.
END_JOB_DEADLINE_S = 5.0
WORKER_NAME = re.compile(r"worker-[0-9]{1,4}")


class Scheduler(JobRecovery):
    def __init__(self, store: JobStore, backend, roots: PathRoots,
                 limits: OperatorLimits | None = None) -> None:
        """`backend`: LocalBackend or KubernetesBackend (prepare, place, release,
        read_logs, reclaim_orphans, leader_lease). `roots`: where run directories and
        models may be; `limits`: the operator's ceilings on a spec."""
        self.store = store
        self.backend = backend
        self.roots = roots
        self.limits = limits or OperatorLimits()
        self._stops: dict[str, threading.Event] = {}
        self._threads: dict[str, threading.Thread] = {}
        self._placements: dict[str, Placement] = {}
        self._dispatchers: dict[str, Dispatcher] = {}
        self._pools: dict[str, ElasticPool] = {}
        self._lock = threading.Lock()
        # PENDING jobs get workers in submission order (scheduler/jobcontrol/queue.py).
        self.queue = PlacementQueue()
        # Set by a shutdown that hands the jobs over to the next scheduler.
        self._handover = threading.Event()

    def submit(self, spec_json: str, job_id: str = "", run_dir: str = "") -> tuple[JobRecord, bool]:
        """Record and start a job. A given job_id makes this idempotent: the same spec
        again returns the existing job and False; another spec under it is a Conflict.
        The spec's paths must lie under the operator's roots and its sizes within the
        operator's ceilings (ValueError naming the field); a full house of active jobs
        is ResourceExhausted."""
        spec = JobSpec.model_validate_json(spec_json)
        if job_id:
            check_job_id(job_id)
        self.limits.check(spec)
        if spec.cluster.workers and not getattr(self.backend, "supports_elastic", False):
            raise ValueError("cluster.workers: this cluster backend runs jobs with fixed "
                             "roles only; leave cluster.workers out")
        model_path = self.roots.model_dir(spec.model.path)
        spec.model.path = str(model_path)
        # The files the task reads (a dataset under the datasets root, its columns),
        # before anything starts.
        check_task(spec, self.roots.datasets)
        job_id = job_id or f"{spec.name[:54]}-{uuid.uuid4().hex[:8]}"
        record = JobRecord(
            job_id=job_id, name=spec.name, spec_json=spec.model_dump_json(),
            num_steps=spec.trainer.num_steps,
            run_dir=str(self.roots.run_dir(run_dir or job_id)),
        )
        with self._lock:
            active = sum(1 for t in self._threads.values() if t.is_alive())
            if self.store.exists(job_id):
                return self._resubmitted(record)
            if active >= self.limits.max_active_jobs:
                raise ResourceExhausted(
                    f"{active} jobs are pending or running, this cluster's ceiling "
                    f"(REFLOW_MAX_ACTIVE_JOBS={self.limits.max_active_jobs}); retry when one ends")
            stored, created = self.store.create(record)
            if not created:
                return self._resubmitted(record)
            self._start_thread(record, resume=False)
        return record, True

    def _start_thread(self, record: JobRecord, resume: bool,
                      adopted: Placement | None = None) -> None:
        stop = threading.Event()
        thread = threading.Thread(target=self._run_job, args=(record, stop, resume, adopted),
                                  name=f"job-{record.job_id}", daemon=True)
        self._stops[record.job_id], self._threads[record.job_id] = stop, thread
        thread.start()

    def _resubmitted(self, record: JobRecord) -> tuple[JobRecord, bool]:
        stored = self.store.get(record.job_id)
        if stored.spec_json != record.spec_json:
            raise Conflict(f"job {record.job_id!r} exists with a different spec; submit under "
                           "a new submission_id, or resend the original spec")
        return stored, False

    def get(self, job_id: str) -> JobRecord:
        return self.store.get(job_id)

    def list(self, limit: int = 100,  # nosec B107 # page_token is a cursor, not a secret
             page_token: str = "") -> tuple[list[JobRecord], str]:
        return self.store.page(limit, page_token)

    def stop(self, job_id: str) -> JobRecord:
        record = self.store.get(job_id)
        stop = self._stops.get(job_id)
        if stop is not None and not record.terminal:
            stop.set()
            self._threads[job_id].join(60)
        return self.store.get(job_id)

    def logs(self, job_id: str, service: str = "", tail_bytes: int = 65536) -> list[ServiceLog]:
        if service and service not in LOG_SERVICES and not WORKER_NAME.fullmatch(service):
            raise ValueError(f"service: {service[:40]!r} is not one of "
                             f"{', '.join(LOG_SERVICES)} or worker-N (an elastic job's worker)")
        if not 1 <= tail_bytes <= MAX_LOG_TAIL_BYTES:
            raise ValueError(f"tail_bytes: {tail_bytes} is out of range; use 1 to {MAX_LOG_TAIL_BYTES}")
        record = self.store.get(job_id)
        # The record's run_dir was confined at submission; the roots may have moved since.
        run_dir = self.roots.run_dir(record.run_dir)
        # An elastic job's workers log as worker-N, whatever their role now.
        pool = sorted({n for names in record.workers.values() for n in names
                       if WORKER_NAME.fullmatch(n)}, key=lambda n: int(n[7:]))
        services = [service] if service else (["replay", *pool] if pool else list(LOG_SERVICES))
        return self.backend.read_logs(run_dir, services, tail_bytes, record.workers)

    def metrics(self, job_id: str, since_step: int = 0, limit: int = 1000) -> list[dict]:
        return self.store.metrics(job_id, since_step, limit)

    def workers_by_role(self) -> dict[str, int]:
        with self._lock:
            placements = dict(self._placements)
            pools = dict(self._pools)
        counts = {"rollout": 0, "trainer": 0}
        for job_id, p in placements.items():
            pool = pools.get(job_id)
            if pool is None:
                counts["rollout"] += len(p.rollout_addresses)
                counts["trainer"] += 1
                continue
            for role, names in pool.by_role().items():
                counts[role] += len(names)
        return counts

    def request_flip(self, job_id: str, worker: int, role: str) -> int:
        """Move one worker of a running elastic job to `role` at the next sync
        boundary (paper §5); returns the flips queued before it."""
        check_job_id(job_id)
        record = self.store.get(job_id)
        with self._lock:
            pool = self._pools.get(job_id)
        if pool is None:
            raise FailedPrecondition(
                f"job {job_id} is {record.phase.lower()} and "
                + ("not elastic (set cluster.workers)" if record.phase == "RUNNING"
                   else "has no workers to flip"))
        return pool.request(worker, role, reason="requested through the API")

    def dispatch_snapshots(self) -> dict[str, dict]:
        """Each running job's dispatcher state: caps, loads, decision counters."""
        with self._lock:
            dispatchers = dict(self._dispatchers)
        return {job_id: d.snapshot() for job_id, d in dispatchers.items()}

    def shutdown(self, handover: bool = False) -> None:
        """Stop watching every job. Without `handover` the jobs stop (STOPPED, the
        trainer checkpointing the step it reached). With it (a scheduler's SIGTERM:
        `helm upgrade`, a drained node) they stay RUNNING for the next scheduler
        (scheduler/jobcontrol/recovery.py): on a backend whose services outlive the scheduler
        they run on untouched and are re-adopted; elsewhere each trainer checkpoints
        the step it reached, the services go down in order, and the next scheduler
        resumes there. PENDING jobs stay PENDING."""
        if handover:
            self._handover.set()
        for job_id in list(self._stops):
            self._stops[job_id].set()
        for thread in list(self._threads.values()):
            thread.join(SHUTDOWN_JOIN_S)
        self.backend.close()

    # --- one job ---------------------------------------------------------------------

    def _start_pool(self, record: JobRecord, spec: JobSpec, placement: Placement,
                    leader: GrpcTrainerClient, leader_host: str) -> ElasticPool:
        """An elastic job's pool (scheduler/placement/elastic.py): every worker but the leader
        loads a warm trainer replica beside its engine."""
        from reflow.worker.client import GrpcWorkerClient

        for address in placement.worker_addresses[1:]:
            GrpcTrainerClient(address).start_job(record.job_id, record.spec_json,
                                                 placement.replay_address, [],
                                                 leader_host=leader_host)
        flip_label = getattr(self.backend, "flip_role", None)
        return ElasticPool(record.job_id, spec, placement.worker_addresses, leader,
                           dispatcher=None, worker_client_factory=GrpcWorkerClient,
                           record=lambda event: None, names=placement.worker_names,
                           # Kubernetes: the pod's reflow.io/role label follows each flip.
                           relabel=(lambda name, role: flip_label(placement, name, role))
                           if flip_label else None)

    def _start_dispatcher(self, record: JobRecord, spec: JobSpec, placement: Placement,
                          rollouts: list[GrpcRolloutClient], run_dir: Path,
                          standby: set[str] | None = None) -> Dispatcher:
        """The job's one dispatcher (reflow.scheduler.generation.dispatch): its prompt stream,
        seeded once for the job, and every rollout worker to route to."""
        task = build_task(spec, self.roots.datasets)
        dispatcher = Dispatcher(record.job_id, spec, GrpcReplayClient(placement.replay_address),
                                dict(zip(placement.rollout_addresses, rollouts)), task,
                                events_path=run_dir / "scheduler_events.jsonl",
                                standby=standby,
                                ledger=DispatchLedger(self.store.redis, record.job_id))
        with self._lock:
            self._dispatchers[record.job_id] = dispatcher
        dispatcher.start()
        return dispatcher

    def _run_job(self, record: JobRecord, stop: threading.Event, resume: bool = False,
                 adopted: Placement | None = None) -> None:
        """One job's life: placed (or, `adopted`, found running by recover()),
        started, watched, torn down. `resume`: the trainer starts from the run's
        newest committed checkpoint."""
        placement: Placement | None = adopted
        dispatcher: Dispatcher | None = None
        resizer: RolloutResizer | None = None
        keep_running = False
        run_dir = Path(record.run_dir)
        try:
            run_dir.mkdir(parents=True, exist_ok=True)
            spec = JobSpec.model_validate_json(record.spec_json)
            if placement is None:
                self.backend.prepare(spec)
                placement = self._place_when_free(record, spec, run_dir, stop)
                if placement is None:
                    if not self._handover.is_set():
                        record.phase, record.reason = "STOPPED", "stopped while waiting for workers"
                    return
                record.phase, record.reason, record.started_at = "RUNNING", "", time.time()
            with self._lock:
                self._placements[record.job_id] = placement
            record.workers = placement.workers
            self.store.save(record)
            self._grant(record.job_id, spec, placement)
            rollouts = [GrpcRolloutClient(a) for a in placement.rollout_addresses]
            trainer = GrpcTrainerClient(placement.trainer_address)
            # Each rollout engine's place in the trainer's weight-sync group, as the
            # trainer will build it (weightsync.RankPlan).
            trainer_host = placement.trainer_host

            def start_rollout(i: int) -> None:
                # Its place in the trainer's weight-sync group as the trainer will build
                # it over the job's engines now (weightsync.RankPlan; a job with a range
                # of rollout workers grows and shrinks), and the trainer's host as of
                # now: its pod may have come back elsewhere.
                plan = RankPlan.for_engines([spec.rollout.tensor_parallel_size] * len(rollouts))
                rollouts[i].start_job(record.job_id, record.spec_json, placement.replay_address,
                                      plan.first_rank(i), plan.world_size,
                                      placement.trainer_host)

            def replace_rollout(i: int, address: str) -> GrpcRolloutClient:
                """Rollout worker i is now at `address` (an idle pod took a lost
                one's place): its client, which start_rollout(i) then starts."""
                rollouts[i] = GrpcRolloutClient(address)
                return rollouts[i]

            pool = None
            if adopted is None:
                pool = self._start_services(record, spec, placement, trainer, trainer_host,
                                            start_rollout, len(rollouts), resume)
            dispatcher = self._start_dispatcher(record, spec, placement, rollouts, run_dir,
                                                pool.standby_engines if pool else set())
            if pool is not None:
                pool.dispatcher, pool.record = dispatcher, dispatcher.record
                pool.start_roles()
                record.workers = pool.by_role()
                with self._lock:
                    self._pools[record.job_id] = pool
            if adopted is not None:
                dispatcher.record({"event": "job_adopted", "step": record.step,
                                   "workers": placement.workers})
            planner = planner_for(spec, len(placement.worker_addresses) or len(rollouts) + 1)
            feed = PlacementFeed(planner, dispatcher, pool) if planner is not None else None
            if pool is None and RolloutResizer.wanted(spec, self.backend):
                resizer = RolloutResizer(record, spec, self.backend, placement, dispatcher,
                                         trainer, rollouts, start_rollout, GrpcRolloutClient,
                                         self.queue, events=dispatcher.record)
            record.phase, record.reason = self._watch(record, placement, trainer, rollouts,
                                                      dispatcher, stop, feed, pool,
                                                      start_rollout, replace_rollout, resizer)
            # A handover leaves the job running only where its services outlive us.
            keep_running = record.phase == "RUNNING" and self._adoptable(pool)
        except Exception as err:  # noqa: BLE001 - the job fails, the scheduler lives on
            logger.exception("job %s failed", record.job_id)
            record.phase, record.reason = "FAILED", f"{type(err).__name__}: {err}"
        finally:
            with self._lock:
                pool = self._pools.pop(record.job_id, None)
            if pool is not None:
                pool.stop()
            if resizer is not None and not keep_running:
                resizer.release_leaving()
            if dispatcher is not None:
                # Its ledger keeps what is in flight, for whoever watches the job next.
                dispatcher.stop()
                dispatcher.replay.close()
            if placement is not None:
                with self._lock:
                    self._placements.pop(record.job_id, None)
                    self._dispatchers.pop(record.job_id, None)
                if record.phase not in ("PENDING", "RUNNING"):
                    # Before the release: a local buffer goes down with the job.
                    self._end_on_buffer(record.job_id, placement)
                if not keep_running:
                    self.backend.release(placement)
                    self.queue.notify()
            if record.phase in ("PENDING", "RUNNING"):
                # Handed over: the next scheduler takes it up (scheduler/jobcontrol/recovery.py).
                self.store.save(record)
            else:
                record.finished_at = time.time()
                self.store.save_final(record)
            logger.info("job %s %s %s", record.job_id, record.phase, record.reason)

    def _grant(self, job_id: str, spec: JobSpec, placement: Placement) -> None:
        """Start the job on the replay buffer (rpcauth): the scheduler's Configure,
        with the job's replay settings, is the buffer's starting call (authz.GRANTING),
        the one that serves a job again after its EndJob, and it comes before the
        trainer configures the job with its pass. The workers are granted the job,
        with their passes, by the calls that start it on them."""
        # Placed services are up: a buffer that does not answer within the channel's
        # own retries (rpc.RETRY_POLICY, a few seconds) fails the job.
        replay = GrpcReplayClient(placement.replay_address, retry_s=0.0)
        try:
            replay.configure(job_id, spec.replay)
        finally:
            replay.close()

    def _end_on_buffer(self, job_id: str, placement: Placement) -> None:
        """The job reached its end: the replay buffer takes its passes no more
        (EndJob; its samples stay, for a resume). Within END_JOB_DEADLINE_S and
        only logged when it fails: the job ends whatever the buffer answers, and
        its passes expire on their own (capabilities.PASS_LIFETIME_S)."""
        try:
            replay = GrpcReplayClient(placement.replay_address, deadline_s=END_JOB_DEADLINE_S,
                                      retry_s=0.0)
            try:
                replay.end_job(job_id)
            finally:
                replay.close()
        except Exception as err:  # noqa: BLE001 - never holds up the job's end
            logger.warning("job %s: the replay buffer was not told the job ended (its passes "
                           "work there until they expire): %s: %s", job_id,
                           type(err).__name__, err)

    def _adoptable(self, pool: ElasticPool | None) -> bool:
        """Whether a job would run on untouched past this scheduler, to be re-adopted:
        a fixed-role job on a backend whose services outlive it."""
        return pool is None and getattr(self.backend, "adopt", None) is not None

    def _start_services(self, record: JobRecord, spec: JobSpec, placement: Placement,
                        trainer: GrpcTrainerClient, trainer_host: str, start_rollout,
                        num_rollouts: int, resume: bool) -> ElasticPool | None:
        """Start the job on its placed services: rollout first (the engine warms
        while the trainer loads), an elastic job's warm replicas, then the trainer,
        from the run's newest checkpoint when resuming. Returns the elastic pool."""
        for i in range(num_rollouts):
            start_rollout(i)
        pool = None
        if placement.worker_addresses:
            pool = self._start_pool(record, spec, placement, trainer, trainer_host)
        resume_from = ""
        if resume:
            from reflow.trainer.checkpoint import latest_checkpoint

            checkpoint = latest_checkpoint(Path(record.run_dir))
            resume_from = checkpoint.path.name if checkpoint is not None else ""
        trainer.start_job(record.job_id, record.spec_json, placement.replay_address,
                          placement.rollout_addresses, record.run_dir,
                          trainer_peers=pool.trainer_peers if pool else [],
                          resume_from=resume_from)
        return pool

    def _place_when_free(self, record: JobRecord, spec: JobSpec, run_dir: Path,
                         stop: threading.Event) -> Placement | None:
        """Place the job once it is at the head of the queue (submission order),
        waiting PENDING (the reason says for what) while the backend has no room;
        None when the job is stopped before it gets any."""
        self.queue.join(record.job_id, record.created_at)
        try:
            while True:
                if not self.queue.wait_turn(record.job_id, stop):
                    return None
                try:
                    if spec.cluster.workers:
                        roles = [spec.cluster.initial_role(i)
                                 for i in range(spec.cluster.workers)]
                        return self.backend.place(record.job_id, run_dir,
                                                  colocated=spec.colocated, roles=roles)
                    if spec.cluster.rollout_range is not None:
                        return self.backend.place(record.job_id, run_dir,
                                                  colocated=spec.colocated,
                                                  rollout_range=spec.cluster.rollout_range)
                    return self.backend.place(record.job_id, run_dir, colocated=spec.colocated)
                except NoCapacity as err:
                    if err.short_of_workers:
                        self.queue.short_of_workers(record.job_id)
                    if record.reason != str(err):
                        record.reason = str(err)
                        self.store.save(record)
                if not self.queue.wait_retry(stop, QUEUE_RETRY_S):
                    return None
        finally:
            self.queue.leave(record.job_id)

    def _hand_over(self, record: JobRecord, trainer: GrpcTrainerClient,
                   pool: ElasticPool | None) -> tuple[str, str]:
        """This scheduler is shutting down and the job goes on under the next one."""
        adoptable = self._adoptable(pool)
        try:
            if not adoptable:
                # The trainer checkpoints the step it reached (TrainLoop.checkpoint_on_stop).
                trainer.stop_job(record.job_id)
            self._update_progress(record, trainer.status(record.job_id, since_step=record.step))
        except Exception as err:  # noqa: BLE001 - the next scheduler takes up what there is
            logger.warning("job %s: handover: %s: %s", record.job_id, type(err).__name__, err)
        if adoptable:
            return "RUNNING", (f"handed over at step {record.step}: its scheduler shut down "
                               "and the next one re-adopts it")
        return "RUNNING", (f"handed over at step {record.step}: its scheduler shut down; "
                           "the next one resumes it from its checkpoint")

    def _watch(self, record: JobRecord, placement: Placement, trainer: GrpcTrainerClient,
               rollouts: list[GrpcRolloutClient], dispatcher: Dispatcher,
               stop: threading.Event, feed: PlacementFeed | None = None,
               pool: ElasticPool | None = None, start_rollout=None,
               replace_rollout=None, resizer: RolloutResizer | None = None) -> tuple[str, str]:
        spec = JobSpec.model_validate_json(record.spec_json)
        controller = JobController(record, spec, self.store, self.backend, placement,
                                   dispatcher.replay, trainer, Path(record.run_dir),
                                   events=dispatcher.record, dispatcher=dispatcher,
                                   start_rollout=start_rollout, pool=pool,
                                   replace_rollout=replace_rollout)
        rollout_polls: dict[str, ConsecutiveFailures] = {}
        trainer_polls = ConsecutiveFailures(f"job {record.job_id}: trainer", MAX_POLL_FAILURES)
        while True:
            if stop.wait(POLL_INTERVAL_S):
                if self._handover.is_set():
                    return self._hand_over(record, trainer, pool)
                trainer.stop_job(record.job_id)
                # The steps finished since the last poll still belong in the history.
                self._update_progress(record, trainer.status(record.job_id, since_step=record.step))
                return "STOPPED", "stopped by request"
            exited = placement.exited()
            if exited:
                name, code, what = exited[0]
                try:
                    controller.on_exit(name, code, what, elastic=pool is not None)
                except PermanentError as err:
                    return "FAILED", f"{err}; see GET /v1/jobs/{record.job_id}/logs"
                continue
            lost = pool.lost_addresses if pool is not None else set()
            for client in list(rollouts):
                if client.address in lost:
                    continue
                polls = rollout_polls.setdefault(client.address, ConsecutiveFailures(
                    f"job {record.job_id}: rollout {client.address}", MAX_POLL_FAILURES))
                stats = polls.call(client.stats, record.job_id)
                if stats is not None and stats.state == "failed":
                    return "FAILED", f"rollout: {stats.error}"
            if dispatcher.error:
                trainer.stop_job(record.job_id)
                return "FAILED", f"dispatcher: {dispatcher.error}"
            status = trainer_polls.call(trainer.status, record.job_id, record.step)
            if status is None:
                continue
            if feed is not None:
                feed.observe(status.metrics)
            if pool is not None:
                pool.schedule(status.step)
                record.workers = pool.by_role()
            self._update_progress(record, status)
            if resizer is not None and status.state == "running":
                resizer.tick(status.policy_version)
                record.workers = placement.workers
                if feed is not None:
                    feed.resize(len(rollouts) + 1)
            if status.state == "succeeded":
                return "SUCCEEDED", ""
            if status.state == "failed":
                return "FAILED", f"trainer: {status.error}"
            if pool is not None and pool.error:
                trainer.stop_job(record.job_id)
                return "FAILED", f"elastic pool: {pool.error}"

    def _update_progress(self, record: JobRecord, status) -> None:
        m = status.last_metrics
        try:
            self.store.append_metrics(record.job_id, status.metrics)
            # The step of the last record stored, not the trainer's counter: that one
            # moves before the step's record exists, and the next poll asks for the
            # records after record.step (a poll in between lost one, now and then).
            if status.metrics:
                record.step = max(record.step, max(int(r["step"]) for r in status.metrics))
            record.policy_version = status.policy_version
            if m:
                record.reward_mean = float(m.get("reward_mean", 0.0))
                record.trainer_tokens_per_s = float(m.get("trainer_tokens_per_s", 0.0))
            self.store.save(record)
        except Unavailable as err:
            # The job store is down: records not stored are fetched again (the step
            # did not advance), the record is saved at the next poll.
            logger.warning("job %s: progress not stored now: %s", record.job_id, err)
