"""A job's controller: its recovery decisions when one of its services dies.

The scheduler's job thread starts the job and watches it (scheduler/jobcontrol/service.py);
when a service process is gone it asks the controller what to do. Every fault
is typed (core/errors.py): a TemporaryError is recovered from, a
PermanentError fails the job.

A dead trainer (paper §4.1's step 3 stops) is restarted: its process comes back
at the same address, the leases it held are returned at once instead of after
their TTL, and it resumes from the run's newest committed checkpoint
(trainer/checkpoint.py). The rollout workers keep generating meanwhile; the
restarted trainer's weight-sync group is a new one, which they re-join, and it
publishes its resumed weights as a version above any seen, so that versions
keep rising. The steps trained after that checkpoint are lost (their records
leave the job's metrics); no sample is handed out as fresh twice, because the
buffer, which outlives the trainer, says what was trained.

A dead replay buffer is started again at its address: its state is all in
Redis, so the new process is the same buffer, and its clients (rollout's puts,
the trainer's leases, the dispatcher's grants) ride the gap out on their retries.

An elastic job's worker that dies (other than the leader's) is not brought
back: the pool goes on without it (scheduler/placement/elastic.py worker_lost), down to
one rollout worker. Worker 0, which holds trainer rank 0, is restarted as a
trainer is: it resumes from the newest checkpoint with the pool's replicas,
which stood by when its group broke, and the engines that remain.

What comes back at the same address is, locally, a new process the backend
starts; on Kubernetes, the lost worker pod itself, once its StatefulSet has
recreated it (or its container restarted) and its worker answers idle
(scheduler/cluster/kube_restart.py): the pod's role in the job says which of the two
services to start on it again.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path

from reflow.core.config import JobSpec
from reflow.core.errors import (ExitedWhileStarting, FailedPrecondition, PermanentError,
                                TemporaryError)
from reflow.core.restart_budget import CrashLoop
from reflow.scheduler.jobcontrol.recovery import backfill_metrics
from reflow.trainer.checkpoint import latest_checkpoint

logger = logging.getLogger(__name__)

# The services of a fixed-role job the controller brings back when they die.
RESTARTABLE = ("trainer", "replay", "rollout")


class JobController:
    def __init__(self, record, spec: JobSpec, store, backend, placement, replay, trainer,
                 run_dir: Path, events=None, dispatcher=None, start_rollout=None,
                 pool=None, replace_rollout=None) -> None:
        """`record`/`store`: the job's record and the job store; `replay`,
        `trainer`: clients of the job's buffer and trainer; `events(dict)`: the
        job's scheduling-event log (the dispatcher's); `dispatcher`: the job's
        dispatcher; `start_rollout(i)`: starts the job on rollout worker i;
        `replace_rollout(i, address)`: rollout worker i is now at `address`, its new
        client; `pool`: an elastic job's ElasticPool."""
        self.record, self.spec, self.store = record, spec, store
        self.backend, self.placement = backend, placement
        self.replay, self.trainer, self.run_dir = replay, trainer, run_dir
        self.events = events or (lambda event: None)
        self.dispatcher, self.start_rollout = dispatcher, start_rollout
        self.replace_rollout = replace_rollout
        self.pool = pool
        self.budget = spec.cluster.restart_budget()
        self.trainer_host = placement.trainer_host
        self.recoveries: list[dict] = []

    def on_exit(self, name: str, code: int, what: str, elastic: bool) -> None:
        """Service `name` is gone (`what` happened, with exit `code`): recover (and
        return) or raise PermanentError with the reason the job fails for."""
        reason = f"{name} {what} (exit code {code})"
        service = self._service_of(name)
        if elastic and self.pool is not None and name in self.pool.names:
            if self.pool.names.index(name):
                self._drop_worker(name, reason)
                return
            service = "trainer"  # worker 0 holds trainer rank 0, and nothing else
        if service not in RESTARTABLE:
            raise PermanentError(f"{reason}; the {' and '.join(RESTARTABLE)} are "
                                 "restarted, nothing else")
        if getattr(self.backend, "restart", None) is None:
            raise PermanentError(f"{reason}; this cluster backend does not restart services")
        restart = {"trainer": lambda: self._restart_trainer(code, name),
                   "rollout": lambda: self._restart_rollout(code, name),
                   "replay": lambda: self._restart_buffer(code)}[service]
        while True:
            self._wait_out_backoff(name)
            try:
                restart()
                return
            except TemporaryError as err:
                if not isinstance(err.__cause__, ExitedWhileStarting):
                    raise PermanentError(f"{reason}; recovery failed: {err}") from err
                # It came back and died while starting: a death like the first, counted
                # against the same budget, so a service that dies at start is a crash
                # loop that fails the job in seconds, not one restart's timeout.
                self._count_restart(name)
                self._recorded({"event": "service_died_starting", "service": service,
                                "worker": name, "error": str(err)[:300]})

    def _drop_worker(self, name: str, reason: str) -> None:
        """An elastic job's worker died: the job goes on without it (its groups in
        flight go out again, the leader leaves it out of the trainer group and the
        weight-sync group), or fails when it cannot."""
        retire = getattr(self.backend, "retire", None)
        if retire is None:
            raise PermanentError(f"{reason}; this cluster backend cannot shrink an elastic job")
        try:
            event = self.pool.worker_lost(name, reason)
        except FailedPrecondition as err:
            raise PermanentError(f"{reason}; {err}") from err
        except Exception as err:  # noqa: BLE001 - a survivor or the leader did not take it
            raise PermanentError(f"{reason}; the job could not go on without it: "
                                 f"{type(err).__name__}: {err}") from err
        finally:
            # Whatever the outcome, what is left of it goes, and it is not reported again.
            retire(self.placement, name)
        if event is not None:
            self.recoveries.append(event)
            self.record.workers = self.pool.by_role()
            self.store.save(self.record)
            logger.warning("job %s: %s", self.record.job_id, event)

    def _service_of(self, name: str) -> str:
        """What ran as `name`: locally the service itself; on Kubernetes a worker pod,
        whose role in the job says."""
        pods = getattr(self.placement, "pods", None)
        if pods and name in pods:
            return pods[name].role
        launches = getattr(self.placement, "launches", None) or {}
        if name in launches and launches[name][0] == "rollout":
            return "rollout"  # a job's second rollout process is `rollout-1`, ...
        return name

    def _address_of(self, name: str) -> str:
        pods = getattr(self.placement, "pods", None)
        if pods and name in pods:
            return pods[name].address
        launches = getattr(self.placement, "launches", None) or {}
        if name in launches:
            return f"127.0.0.1:{launches[name][1]}"
        return self.placement.rollout_addresses[0]

    def _restart_buffer(self, code: int) -> None:
        """The replay buffer keeps nothing of its own (its state is in Redis, every
        transition one atomic script): a new process at the same address is the
        same buffer. Its clients ride out the gap on their retries."""
        started = time.monotonic()
        try:
            self.backend.restart(self.placement, "replay")
        except Exception as err:  # noqa: BLE001 - typed here: the restart may be retried
            raise TemporaryError(f"replay buffer did not come back: {type(err).__name__}: "
                                 f"{err}") from err
        self._count_restart("replay")
        self._recorded({"event": "service_restarted", "service": "replay", "exit_code": code,
                        "restart_s": round(time.monotonic() - started, 3)})

    def _restart_rollout(self, code: int, name: str = "rollout") -> None:
        """A rollout worker comes back at its address, from model.path: the
        groups it held go out again (the dispatcher's worker_lost), and the trainer,
        whose next weight update to it fails, builds a new weight-sync group once
        it runs and publishes the trained weights to it (trainer/publish.py). On
        Kubernetes an idle pod may take its place instead (cluster/kube_restart.py):
        its engine takes the lost one's rank, and the dispatcher and the trainer
        swap the one address for the other."""
        if self.dispatcher is None or self.start_rollout is None:
            raise PermanentError("rollout worker died; this job cannot start a new one")
        started = time.monotonic()
        address = self._address_of(name)
        index = self.placement.rollout_addresses.index(address)
        rerouted = self.dispatcher.worker_lost(address)
        try:
            serving = self.backend.restart(self.placement, name) or name
            now_at = self.placement.rollout_addresses[index]
            client = None
            if now_at != address:
                if self.replace_rollout is None:
                    raise PermanentError(f"{name} was replaced by {serving}, which this job "
                                         "cannot take in")
                client = self.replace_rollout(index, now_at)
            self.start_rollout(index)
            if client is not None:
                self._take_in_replacement(address, now_at, client)
        except PermanentError:
            raise
        except Exception as err:  # noqa: BLE001 - typed here: the restart may be retried
            raise TemporaryError(f"rollout worker did not come back: {type(err).__name__}: "
                                 f"{err}") from err
        self._count_restart(name)
        event = {"event": "service_restarted", "service": "rollout", "exit_code": code,
                 "worker": name, "groups_rerouted": rerouted,
                 "restart_s": round(time.monotonic() - started, 3)}
        if serving != name:
            event.update(replaced_by=serving, address=now_at)
        self._recorded(event)

    def _take_in_replacement(self, lost: str, address: str, client) -> None:
        """The engine at `address` has the lost one's place: the dispatcher routes to
        it once it runs, and the trainer publishes to it (its next weight-sync group
        has the new engine at the lost one's rank)."""
        self.dispatcher.replace_worker(lost, address, client)
        self.trainer.reconfigure(self.record.job_id, None,
                                 rollout_addresses=list(self.placement.rollout_addresses))
        self.record.workers = self.placement.workers
        self.store.save(self.record)

    def _wait_out_backoff(self, name: str) -> None:
        """Raise PermanentError for a crash loop (more than cluster.max_restarts
        deaths of `name` within cluster.restart_window_s), else wait the backoff
        its recent restarts earn (core/restart_budget.py)."""
        try:
            wait = self.budget.admit(name, self.record.restart_times.get(name, []), time.time())
        except CrashLoop as err:
            raise PermanentError(f"{name} died; {err}") from err
        if wait:
            logger.warning("job %s: %s restarts in %.1f s (it restarted within the last "
                           "%g s)", self.record.job_id, name, wait, self.budget.window_s)
            time.sleep(wait)

    def _tell_engines_the_trainer_host(self) -> None:
        """A trainer pod recreated at a new IP sets its weight-sync group up there:
        each engine still in the job accepts joins from the new host from now on
        (its address, a DNS name, did not change)."""
        host = self.placement.trainer_host
        if host == self.trainer_host:
            return
        lost = self.pool.lost_addresses if self.pool is not None else set()
        clients = getattr(self.dispatcher, "clients", {}) if self.dispatcher else {}
        for address, client in clients.items():
            if address in lost:
                continue
            try:
                client.set_sync_place(self.record.job_id, 0, 0, trainer_host=host)
            except Exception as err:  # noqa: BLE001 - that engine's join fails; it is rebuilt
                logger.warning("job %s: engine %s not told the trainer's new host %s: %s",
                               self.record.job_id, address, host, err)
        logger.info("job %s: the trainer's weight-sync host %s -> %s", self.record.job_id,
                    self.trainer_host, host)
        self.trainer_host = host

    def _count_restart(self, name: str) -> None:
        now = time.time()
        self.record.restarts[name] = self.record.restarts.get(name, 0) + 1
        self.record.restart_times[name] = [
            *self.budget.recent(self.record.restart_times.get(name, []), now), now]
        self.store.save(self.record)

    def _recorded(self, event: dict) -> None:
        self.recoveries.append(event)
        self.events(event)
        logger.warning("job %s: %s", self.record.job_id, event)

    def _restart_trainer(self, code: int, name: str = "trainer") -> None:
        started = time.monotonic()
        job_id = self.record.job_id
        dead_step = self.record.step
        checkpoint = latest_checkpoint(self.run_dir)
        interval = self.spec.trainer.checkpoint_interval
        if (checkpoint is None and interval and dead_step >= interval
                and not (self.run_dir / "metrics.jsonl").exists()):
            # One was due, and not even the trainer's metrics are there: the run
            # directory the scheduler reads is not the one the trainer wrote to.
            # Starting over from step 0 would be silent loss.
            raise PermanentError(
                f"the trainer reached step {dead_step} but no committed checkpoint is under "
                f"{self.run_dir} where the scheduler looks; on Kubernetes give the scheduler "
                "and the workers one run volume (worker.runs.existingClaim, ReadWriteMany)")
        try:
            self.backend.restart(self.placement, name)
        except Exception as err:  # noqa: BLE001 - typed here: the restart may be retried
            raise TemporaryError(f"trainer did not come back: {type(err).__name__}: {err}") from err
        self._tell_engines_the_trainer_host()
        # The dead incarnation's leases: every lease of the job (one leader at a time).
        returned = self.replay.return_all_leases(job_id)
        # Newer than the one looked at above if the dying trainer's last save committed.
        checkpoint = latest_checkpoint(self.run_dir)
        step = checkpoint.step if checkpoint is not None else 0
        # Steps after the checkpoint are trained again; each keeps one record. Steps
        # up to it that the dead trainer recorded after the last poll come from its
        # metrics.jsonl, or the curve would skip them.
        self.store.drop_metrics_after(job_id, step)
        backfill_metrics(self.store, job_id, self.run_dir, step)
        self.record.step = step
        self._count_restart(name)
        # An elastic job's leader takes its replicas back and publishes to the engines
        # still in the job (those of lost workers left it).
        lost = self.pool.lost_addresses if self.pool is not None else set()
        self.trainer.start_job(job_id, self.record.spec_json, self.placement.replay_address,
                               [a for a in self.placement.rollout_addresses if a not in lost],
                               str(self.run_dir),
                               trainer_peers=self.pool.trainer_peers if self.pool else [],
                               resume_from=checkpoint.path.name if checkpoint else "")
        # The steps lost are counted by the resumed trainer, from the dead one's own
        # records (its first record's superseded_steps); the scheduler saw this much.
        event = {"event": "service_restarted", "service": "trainer", "exit_code": code,
                 "worker": name,
                 "polled_step_at_death": dead_step, "resumed_step": step,
                 "leases_returned": returned,
                 "checkpoint": checkpoint.path.name if checkpoint else "",
                 "restart_s": round(time.monotonic() - started, 3)}
        self._recorded(event)
