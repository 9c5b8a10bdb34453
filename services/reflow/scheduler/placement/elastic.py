"""The elastic resource pool of one job (paper §5): AsyncHybrid workers whose
roles move between rollout and trainer while the job runs.

Worker 0 holds trainer rank 0 (the leader: it leases batches and publishes
weights) and keeps it. Every other worker holds a warm engine, in the job's
weight-sync group from the start, and a warm trainer replica. A flip:
- rollout -> trainer: the dispatcher stops routing to the worker; the worker's
  engine stops admitting, and its groups in flight come back to the dispatcher,
  which routes them to the other rollout workers with their budget
  (`cluster.flip_inflight: return`), or finish into the buffer first
  (`finish`); the leader takes the replica into its group at the next sync
  boundary, sending it parameters and optimizer state.
- trainer -> rollout: the leader drops the replica from its group at the next
  sync boundary; the engine, which has loaded every published version
  meanwhile, admits again; the dispatcher routes to it once it reports running.
Flips run one at a time, each a scheduling event with its phases timed, and
the job's record lists the workers by role. An hsdp trainer group
(trainer.parallelism: hsdp) holds whole replicas of trainer.shard_size ranks,
so its workers flip a replica at a time: the replica's workers drain together
and the leader takes them in (or drops them) in one membership change, where
a new replica copies its shards from a replica that holds them and a leaving
one hands nothing on. A flip is a sequence of calls and
waits (a generator that yields while it waits on a worker, the dispatcher or the
leader); the pool's thread carries flips out on wall time, polling each wait,
and the simulator (reflow.sim) carries the same generators out with `step()` at
its events, on its virtual clock (the pool reads time through one `Clock`).

A worker other than the leader that dies leaves the pool (`worker_lost`): the
job goes on with one worker fewer, as long as a rollout worker and
cluster.min_workers workers are left. Its
groups in flight go out again; the surviving engines take their places in a
smaller weight-sync group; the leader is told which engines remain and which
replicas, and drops a dead replica from its group at once (the step it broke is
trained again, trainer/membership.py).
"""

from __future__ import annotations

import logging
import queue
import re
import threading
from dataclasses import dataclass
from typing import Callable, Iterator

from reflow.core.clock import WALL_CLOCK, Clock
from reflow.core.config import JobSpec
from reflow.core.errors import FailedPrecondition
from reflow.weightsync import RankPlan

logger = logging.getLogger(__name__)

# How long a flip may wait for the trainer's next sync boundary, and for the
# samples in flight on a worker moving to the trainer role.
BOUNDARY_TIMEOUT_S = 900.0
DRAIN_TIMEOUT_S = 300.0
POLL_S = 0.1

# An FSDP group's account of a membership change (trainer/reshard.describe_moves).
_SHARD_MOVES = re.compile(r"shards (\d+) B to joiners, (\d+) B between members, of (\d+) B")


def shard_moves(handoff: str) -> dict[str, int]:
    """The bytes an FSDP flip moved, as the flip event's numbers: to the joiners,
    between the other members, and the whole unsharded state they are shards of."""
    match = _SHARD_MOVES.fullmatch(handoff or "")
    if match is None:
        return {}
    to_joiners, between, full = map(int, match.groups())
    return {"shard_bytes_to_joiners": to_joiners, "shard_bytes_between_members": between,
            "state_bytes": full}


class JobEnded(FailedPrecondition):
    """The trainer finished (or stopped) before the flip's sync boundary: the flip
    is dropped, the job is not failed for it."""


@dataclass
class FlipRequest:
    workers: tuple[int, ...]
    """One worker, or an hsdp replica's (trainer.parallelism: hsdp), which flip in
    one membership change."""
    role: str
    reason: str
    scripted: int = 0
    """The flip's place (1-based) in the spec's cluster.flips (its last, for a
    replica's); 0: not scripted."""
    refused: bool = False
    """A scripted flip refused when it was due: only reported to the leader."""

    @property
    def worker(self) -> int:
        return self.workers[0]


class ElasticPool:
    def __init__(self, job_id: str, spec: JobSpec, worker_addresses: list[str], leader,
                 dispatcher, worker_client_factory: Callable[[str], object],
                 record: Callable[[dict], None], names: list[str] | None = None,
                 relabel: Callable[[str, str], object] | None = None,
                 clock: Clock = WALL_CLOCK) -> None:
        """`leader`: the trainer client of worker 0; `dispatcher` the job's
        Dispatcher (keyed by the rollout workers' addresses); `record` writes a
        scheduling event; `names` the workers' names (pods on Kubernetes);
        `relabel(name, role)` records a carried-out flip in the cluster (the
        pod's role label); `clock` times the phases and bounds the waits."""
        self.job_id, self.spec, self.clock = job_id, spec, clock
        self.addresses = list(worker_addresses)
        self.names = list(names or [f"worker-{i}" for i in range(len(self.addresses))])
        self.relabel = relabel
        self.roles = [spec.cluster.initial_role(i) for i in range(len(self.addresses))]
        # Workers move between roles this many at a time: one hsdp replica.
        self.unit = spec.trainer.shard_size or 1
        self.leader, self.dispatcher, self.record = leader, dispatcher, record
        self._workers = {i: worker_client_factory(a) for i, a in enumerate(self.addresses) if i}
        self._queue: queue.Queue[FlipRequest | None] = queue.Queue()
        # Roles once every queued flip is done: what a new request is checked against.
        self._planned = list(self.roles)
        self._scheduled = 0  # spec.cluster.flips requested so far
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=f"elastic-{job_id[:20]}",
                                        daemon=True)
        self._active: Iterator[None] | None = None  # the flip step() carries out
        self.flips_done = 0
        self.error = ""

    # --- set-up -------------------------------------------------------------------------

    def start_roles(self, thread: bool = True) -> None:
        """Give every worker but the leader its initial role. `thread`: carry the
        flips out on the pool's thread (wall time); False: the caller drives them
        with `step()` (a simulation on a virtual clock)."""
        for i, client in self._workers.items():
            client.set_role(self.job_id, self.roles[i], 0.0)
        if thread:
            self._thread.start()

    @property
    def trainer_peers(self) -> list[str]:
        return [a for i, a in enumerate(self.addresses) if i and self.roles[i] == "trainer"]

    @property
    def standby_engines(self) -> set[str]:
        return {a for i, a in enumerate(self.addresses) if i and self.roles[i] == "trainer"}

    def by_role(self) -> dict[str, list[str]]:
        with self._lock:
            roles = ("trainer", "rollout") + (("lost",) if "lost" in self.roles else ())
            return {role: [self.names[i] for i, r in enumerate(self.roles) if r == role]
                    for role in roles}

    @property
    def lost_addresses(self) -> set[str]:
        with self._lock:
            return {a for a, r in zip(self.addresses, self.roles) if r == "lost"}

    # --- requests -----------------------------------------------------------------------

    def request(self, worker: int, role: str, reason: str = "requested") -> int:
        """Queue a flip of `worker` to `role`; returns the flips queued before it.
        Refused (ValueError naming the field) if it names no flippable worker, or
        would leave the job without a rollout worker, or the trainer group holds
        whole hsdp replicas (Algorithm 1's `rebalance` moves those)."""
        if self.unit > 1:
            raise FailedPrecondition(
                f"worker: trainer.parallelism: hsdp moves whole replicas of "
                f"trainer.shard_size ({self.unit}) workers, not one; Algorithm 1 "
                "(scheduler.placement) moves them")
        return self._enqueue((worker,), role, reason, 0)

    def _enqueue(self, workers: tuple[int, ...], role: str, reason: str, scripted: int) -> int:
        """Queue one flip of `workers` (one, or a whole hsdp replica: they drain
        together and join or leave the trainer group in one membership change)."""
        if role not in ("rollout", "trainer"):
            raise ValueError(f"role: {role[:40]!r} is not one of rollout, trainer")
        with self._lock:
            planned = list(self._planned)
            for worker in workers:
                if not 1 <= worker < len(self.addresses):
                    raise ValueError(f"worker: {worker} is not a flippable worker of this job "
                                     f"(1 to {len(self.addresses) - 1}; 0 holds trainer rank 0)")
                if planned[worker] == "lost":
                    raise FailedPrecondition(f"worker {worker} was lost; the job goes on "
                                             "without it")
                if planned[worker] == role:
                    raise FailedPrecondition(f"worker {worker} is already a {role} worker "
                                             "(or a queued flip makes it one)")
                planned[worker] = role
            if "rollout" not in planned[1:]:
                raise FailedPrecondition("the flip would leave the job without a rollout worker")
            self._planned = planned
            queued = self._queue.qsize()
            self._queue.put(FlipRequest(workers, role, reason, scripted))
        return queued

    @property
    def busy(self) -> bool:
        """A flip is queued or under way."""
        with self._lock:
            return self._planned != self.roles

    def rebalance(self, rollout_workers: int, reason: str) -> int:
        """Move workers toward `rollout_workers` rollout workers (the rest train), as
        Algorithm 1 chose; the highest-numbered workers move first (the trainer
        group's last ranks: a leaving hsdp replica is its last one, whole). Returns
        the workers moving (0 while another flip is under way)."""
        if self.busy:
            return 0
        with self._lock:
            roles = list(self.roles)
        delta = rollout_workers - roles.count("rollout")
        source, target = ("trainer", "rollout") if delta > 0 else ("rollout", "trainer")
        movable = [i for i in range(len(roles) - 1, 0, -1) if roles[i] == source]
        moving = movable[:abs(delta) // self.unit * self.unit]
        for at in range(0, len(moving), self.unit):
            self._enqueue(tuple(sorted(moving[at:at + self.unit])), target,
                          f"placement: {reason}", 0)
        return len(moving)

    def schedule(self, step: int) -> None:
        """Queue the spec's flips (cluster.flips) whose step the trainer has reached.
        The leader holds that step's sync boundary until each is reported to it, in
        order: carried out (its membership pending) or refused."""
        flips = self.spec.cluster.flips
        while self._scheduled < len(flips) and flips[self._scheduled].at_step <= step:
            # An hsdp replica's flips (the spec holds them together) go as one.
            replica = flips[self._scheduled:self._scheduled + self.unit]
            flip = replica[0]
            self._scheduled += len(replica)
            reason = f"cluster.flips at step {flip.at_step}"
            try:
                self._enqueue(tuple(f.worker for f in replica), flip.role, reason,
                              self._scheduled)
            except (ValueError, FailedPrecondition) as err:
                self.record({"event": "role_flip_refused", "worker": flip.worker,
                             "to": flip.role, "error": str(err)})
                # After the flips queued before it, so the leader learns of them first.
                self._queue.put(FlipRequest((flip.worker,), flip.role, reason,
                                            self._scheduled, refused=True))

    def stop(self) -> None:
        self._stop.set()
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(10)

    # --- a lost worker -------------------------------------------------------------------

    def worker_lost(self, name: str, reason: str) -> dict | None:
        """Worker `name` died: the job goes on without it. Returns the scheduling
        event recorded (None if it had left already). FailedPrecondition when the job
        cannot go on: the leader's worker, or the last rollout worker."""
        with self._lock:
            if name not in self.names:
                raise KeyError(f"{name}: not a worker of this job")
            i = self.names.index(name)
            if i == 0:
                raise FailedPrecondition(f"{name} held trainer rank 0 (the leader); the job "
                                         "continues from its last checkpoint with a resume")
            if self.roles[i] == "lost":
                return None
            role = self.roles[i]
            roles = list(self.roles)
            roles[i] = "lost"
            if "rollout" not in roles[1:]:
                raise FailedPrecondition(f"{name} was the job's last rollout worker")
            left = len(roles) - roles.count("lost")
            if left < self.spec.cluster.min_workers:
                raise FailedPrecondition(f"{left} workers would be left, below "
                                         f"cluster.min_workers={self.spec.cluster.min_workers}")
            self.roles[i] = self._planned[i] = "lost"
        started = self.clock.monotonic()
        address = self.addresses[i]
        rerouted = self.dispatcher.worker_retired(address)
        # The surviving engines' places in the smaller weight-sync group first: the
        # leader rebuilds it (once its publish to the lost engine failed) over the
        # engines it is told of next, numbered the same way (weightsync.RankPlan).
        engines = [a for j, a in enumerate(self.addresses) if j and self.roles[j] != "lost"]
        plan = RankPlan.for_engines([self.spec.rollout.tensor_parallel_size] * len(engines))
        for j, engine in enumerate(engines):
            try:
                self.dispatcher.clients[engine].set_sync_place(self.job_id, plan.first_rank(j),
                                                               plan.world_size)
            except Exception as err:  # noqa: BLE001 - lost too (it dies with this one): its
                # own loss is reported next and places the engines left again.
                logger.warning("job %s: engine %s not told its place %d/%d: %s", self.job_id,
                               engine, plan.first_rank(j), plan.world_size, err)
        epoch = self.leader.reconfigure(self.job_id, self.trainer_peers, engines)
        event = {"event": "worker_left_pool", "worker": i, "name": name, "role": role,
                 "reason": reason, "groups_rerouted": rerouted, "membership_epoch": epoch,
                 "workers_left": len(engines) + 1,
                 "handled_s": round(self.clock.monotonic() - started, 3)}
        self.record(event)
        return event

    # --- carrying flips out -------------------------------------------------------------

    def _run(self) -> None:
        """The pool's thread: each flip in turn, its waits polled on wall time."""
        while not self._stop.is_set():
            flip = self._queue.get()
            if flip is None:
                return
            flow = self._handle(flip)
            for _ in flow:
                if self._stop.wait(POLL_S):
                    flow.close()  # the job is ending: the flip goes with it
                    return
            if self.error:
                return

    def step(self) -> bool:
        """Carry the queued flips as far as they go without waiting: the driver of a
        pool started with `start_roles(thread=False)`, called at each of a
        simulation's events. Returns whether a flip began or ended (the dispatcher
        may route differently). Stops at a failed flip, as the thread does."""
        moved = False
        while not self.error:
            if self._active is None:
                try:
                    flip = self._queue.get_nowait()
                except queue.Empty:
                    return moved
                if flip is None:
                    return moved
                self._active, moved = self._handle(flip), True
            try:
                next(self._active)
                return moved  # waiting on a worker, the dispatcher or the leader
            except StopIteration:
                self._active, moved = None, True
        return moved

    def _handle(self, flip: FlipRequest) -> Iterator[None]:
        """One request, refused, dropped or carried out; a failure sets `error` (the
        job watcher fails the job for it)."""
        if flip.refused:
            self._report_scripted(flip.scripted)
            return
        lost = [w for w in flip.workers if self.roles[w] == "lost"]
        if lost:
            with self._lock:  # the rest of a replica stays where it is
                for w in flip.workers:
                    self._planned[w] = self.roles[w]
            self.record({"event": "role_flip_dropped", "worker": flip.worker,
                         "to": flip.role, "reason": f"worker {lost[0]} was lost"})
            self._report_scripted(flip.scripted)
            return
        try:
            yield from self._flip(flip)
        except JobEnded as err:
            self._report_scripted(flip.scripted)
            self.record({"event": "role_flip_dropped", "worker": flip.worker,
                         "to": flip.role, "reason": str(err)[:500]})
        except Exception as err:  # noqa: BLE001 - the job watcher fails the job
            self._report_scripted(flip.scripted)
            if any(self.roles[w] == "lost" for w in flip.workers):  # died during its flip
                self.record({"event": "role_flip_dropped", "worker": flip.worker,
                             "to": flip.role, "reason": f"the worker was lost: {err}"[:500]})
                return
            logger.exception("job %s: role flip failed", self.job_id)
            self.error = f"flip of worker {flip.worker} to {flip.role}: {err}"
            self.record({"event": "role_flip_failed", "worker": flip.worker,
                         "to": flip.role, "error": str(err)[:500]})

    def _until(self, ready: Callable[[], bool], timeout_s: float, what: str) -> Iterator[None]:
        """Wait (yield to the driver) until `ready()`; TimeoutError naming `what`
        after `timeout_s` on the pool's clock."""
        deadline = self.clock.monotonic() + timeout_s
        while not ready():
            if self.clock.monotonic() > deadline:
                raise TimeoutError(f"{what} not within {timeout_s:.0f}s")
            yield

    def _report_scripted(self, scripted: int) -> None:
        """Tell the leader a scripted flip was dealt with without a membership of
        its own (refused, dropped or failed), so its boundary does not wait on."""
        if not scripted:
            return
        try:
            self.leader.reconfigure(self.job_id, None, scripted_flips=scripted)
        except Exception as err:  # noqa: BLE001 - the leader goes on after its wait bound
            logger.warning("job %s: scripted flip %d not reported to the leader: %s",
                           self.job_id, scripted, err)

    def _flip(self, flip: FlipRequest) -> Iterator[None]:
        workers = flip.workers
        addresses = [self.addresses[w] for w in workers]
        source = self.roles[flip.worker]
        clock = self.clock
        started = clock.monotonic()
        phases: dict[str, float] = {}
        in_flight = 0
        if flip.role == "trainer":
            # Out of routing first, so nothing new lands while the engines drain.
            for address in addresses:
                self.dispatcher.set_standby(address, True)
            t = clock.monotonic()
            hand_back = self.spec.cluster.flip_inflight == "return"
            returned_before = self.dispatcher.returned_groups
            for worker in workers:
                client = self._workers[worker]
                role = client.set_role(self.job_id, "trainer", DRAIN_TIMEOUT_S, hand_back)
                if role.engine_inflight:
                    # A worker that answered before its engine drained (a simulated
                    # one, whose generation runs on the virtual clock): wait for it.
                    yield from self._until(
                        lambda c=client: c.role(self.job_id).engine_inflight == 0,
                        DRAIN_TIMEOUT_S, f"the drain of worker {worker}'s engine")
            phases["drain_s"] = clock.monotonic() - t
            # The dispatcher's count of the workers' samples still out: the drain
            # ended each in the buffer, so this is 0 unless something was lost.
            for address in addresses:
                in_flight += yield from self._await_events(address)
            for worker in workers:
                self._set_role(worker, "trainer")
            status = yield from self._regroup(phases, flip.scripted)
        else:
            for worker in workers:
                self._set_role(worker, "rollout")
            status = yield from self._regroup(phases, flip.scripted)
            t = clock.monotonic()
            for worker, address in zip(workers, addresses):
                self._workers[worker].set_role(self.job_id, "rollout", 0.0)
                self.dispatcher.set_standby(address, False)
            while not all(self.dispatcher.routable(a) for a in addresses):
                yield
            phases["admit_s"] = clock.monotonic() - t
        if self.relabel is not None:
            t = clock.monotonic()
            for worker in workers:
                self._relabel(worker, flip.role)
            phases["relabel_s"] = clock.monotonic() - t
        total = clock.monotonic() - started
        self.flips_done += 1
        self.dispatcher.role_flips[f"{source}->{flip.role}"] += len(workers)
        for worker in workers:
            self.record({"event": "role_flip", "worker": worker,
                         "name": self.names[worker], "from": source,
                         "to": flip.role, "reason": flip.reason,
                         **({"replica": list(workers)} if len(workers) > 1 else {}),
                         **{k: round(v, 3) for k, v in phases.items()},
                         # The flip's own work, without the wait for the sync boundary.
                         "flip_s": round(total - phases["wait_boundary_s"], 3),
                         "total_s": round(total, 3),
                         "trainer_group_size": status["group_size"],
                         "membership_epoch": status["epoch"],
                         **({"state_handoff": status["state_handoff"]}
                            if status["state_handoff"] else {}),
                         **shard_moves(status["state_handoff"]),
                         **({"samples_in_flight": in_flight,
                             "returned_groups": self.dispatcher.returned_groups
                             - returned_before}
                            if flip.role == "trainer" else {})})

    def _relabel(self, worker: int, role: str) -> None:
        try:
            self.relabel(self.names[worker], role)
        except Exception as err:  # noqa: BLE001 - the worker has flipped; the label lags
            logger.warning("job %s: %s flipped to %s but its label did not follow: %s",
                           self.job_id, self.names[worker], role, err)
            self.record({"event": "role_label_failed", "worker": worker,
                         "to": role, "error": str(err)[:500]})

    def _await_events(self, address: str, timeout_s: float = 10.0) -> Iterator[None]:
        """Samples the dispatcher still counts out on a worker that left rollout,
        once its last events (samples ended, groups put or handed back) have reached
        the dispatcher (its event reader lags by a poll): 0 unless one was lost."""
        deadline = self.clock.monotonic() + timeout_s
        while self.dispatcher.inflight(address) and self.clock.monotonic() < deadline:
            yield
        return self.dispatcher.inflight(address)

    def _set_role(self, worker: int, role: str) -> None:
        with self._lock:
            self.roles[worker] = role

    def _regroup(self, phases: dict[str, float], scripted: int = 0) -> Iterator[None]:
        """Hand the leader the new membership and wait until its group applied it at
        a sync boundary; adds the wait for the boundary and the rebuild to `phases`.
        `scripted`: the flip's place in cluster.flips (0: not scripted)."""
        started = self.clock.monotonic()
        try:
            epoch = self.leader.reconfigure(self.job_id, self.trainer_peers,
                                            scripted_flips=scripted)
        except Exception:
            # A leader that has finished refuses the change: the job ended first.
            state = self.leader.status(self.job_id).state
            if state in ("succeeded", "failed", "stopped"):
                raise JobEnded(f"the trainer {state} before the flip's sync boundary") from None
            raise
        deadline = started + BOUNDARY_TIMEOUT_S
        while True:
            status = self.leader.status(self.job_id)
            if status.membership_epoch >= epoch:
                phases["regroup_s"] = status.last_regroup_s
                phases["wait_boundary_s"] = (self.clock.monotonic() - started
                                             - status.last_regroup_s)
                return {"group_size": status.group_size, "epoch": status.membership_epoch,
                        "state_handoff": status.last_state_handoff}
            if status.state in ("succeeded", "failed", "stopped"):
                raise JobEnded(f"the trainer {status.state} before the flip's sync boundary")
            if self.clock.monotonic() > deadline:
                raise TimeoutError(f"no sync boundary within {BOUNDARY_TIMEOUT_S:.0f}s")
            yield
