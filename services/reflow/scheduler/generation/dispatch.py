"""The job's one global dispatcher (paper §4.1 step 1 and §6.1).

The scheduler runs one `Dispatcher` per running job. It owns the job's prompt
stream, so each prompt is dispatched once whatever the number of rollout
workers; it takes dispatch budget from the replay buffer (one B_max budget for
the job, `JobSpec.dispatch_limits`, refunded by evictions); and it routes each
GRPO group to the least-loaded admissible worker (`generation.route`). Workers
only generate. It learns that a sample ended from the worker's event log (a
long poll per worker) and frees that sample's concurrency slot then. A slow
loop reads each worker's KV-cache use and preemptions and moves its
concurrency cap (`generation.ConcurrencyController`).

Budget and versions: the budget's version bound uses the version the buffer
has published, which the trainer publishes only after every rollout worker has
loaded it; so in sync mode nothing is dispatched between the trainer's release
and the new weights reaching every worker.

Threads: one dispatch loop, one event reader per worker, one control loop;
all state under one condition variable. Each loop's body is a public round
(`dispatch_round`, `apply_events`, `control_round`) that reads time through the
dispatcher's clock (core/clock.py): the simulator (reflow.sim) calls the same
rounds on virtual time, without the threads. A worker that cannot be reached is
retried; one that keeps failing is taken out of routing (the job's watcher
fails the job when a worker process dies). A buffer that stays unreachable past
its client's retries ends the dispatch loop with a one-line error that the
watcher reports; one closed under the loop at the job's end ends it quietly.

Dynamic sampling (`algorithm.dynamic_sampling`, DAPO §3.2): a group whose
rewards were all equal never reaches the buffer; its worker ends it with a
GROUP_FILTERED event, and its grant draws a new prompt from the stream
(over-sampling, so batches stay full). The grant is reused here, not refunded
to the buffer: the buffer counted it once as dispatched and receives exactly
one group for it, the replacement, so its dispatch bounds stay exact (sync
mode still dispatches one batch per version, the replacements generated under
that version). Until its grant is routed again the filtered group stays in
the ledger, and the route that spends the grant removes it atomically with
its own entry: a dispatcher resumed in between routes the filtered group again,
on its grant, and no grant is lost or counted twice.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Protocol

from reflow.core.clock import WALL_CLOCK, Clock
from reflow.core.config import JobSpec
from reflow.core.errors import Unavailable
from reflow.replay.client import ReplayClient
from reflow.scheduler.generation.inflight import DispatchLedger
from reflow.scheduler.generation.workers import WorkerMembership
from reflow.rollout.client import RolloutStats
from reflow.tasks import Prompt, Task
from reflow.rollout.records import GROUP_FILTERED, GROUP_RETURNED, SampleEvent
from reflow.scheduler.generation.concurrency import (ConcurrencyController, LengthEstimator, WorkerLoad,
                                         route)

logger = logging.getLogger(__name__)

# Budget polling while the buffer refuses (backing off to the maximum), the
# long-poll wait for worker events, and submission retries before a worker is
# taken out of routing.
BUDGET_POLL_S, BUDGET_POLL_MAX_S = 0.01, 0.04
EVENT_WAIT_S = 1.0
SUBMIT_ATTEMPTS, SUBMIT_RETRY_S = 5, 0.5
READY_POLL_S = 0.2
ROUTE_RETRY_S = 0.25


class WorkerClient(Protocol):
    """What the dispatcher needs of a rollout worker (GrpcRolloutClient or
    InprocRolloutClient)."""

    def submit_group(self, job_id: str, group_id: str, prompt: Prompt,
                     concurrency_cap: int = 0, bounds: tuple[int, int] | None = None) -> bool: ...

    def wait_events(self, job_id: str, since_seq: int, wait_s: float) -> list[SampleEvent]: ...

    def stats(self, job_id: str) -> RolloutStats: ...


@dataclass
class _Group:
    worker: WorkerLoad
    prompt: Prompt
    # Predicted KV tokens per sample (prompt + T̂), released as each sample ends.
    tokens_per_sample: float
    remaining: int


class Dispatcher(WorkerMembership):
    def __init__(self, job_id: str, spec: JobSpec, replay: ReplayClient,
                 workers: dict[str, WorkerClient], task: Task,
                 events_path: Path | None = None, standby: set[str] | None = None,
                 ledger: DispatchLedger | None = None, clock: Clock = WALL_CLOCK,
                 new_group_id: Callable[[], str] | None = None) -> None:
        """`workers`: name -> client of each rollout worker of the job; `task` the
        job's prompt stream (seeded once for the job); `events_path` a JSONL file
        that receives every scheduling decision (None: the log only); `standby`:
        workers of an elastic job that start in the trainer role (never routed to
        until `set_standby(name, False)`); `ledger`: the job's durable stream
        position and groups in flight (scheduler/generation/inflight.py), from which a
        resumed job continues; `clock` what its rounds read time from;
        `new_group_id` names each new group (random by default; a simulation
        numbers them, so that one seed gives one result)."""
        if not workers:
            raise ValueError("workers: a job needs at least one rollout worker")
        self.job_id, self.spec, self.replay, self.task = job_id, spec, replay, task
        self.clock = clock
        self._new_group_id = new_group_id or (lambda: uuid.uuid4().hex[:16])
        self.clients = dict(workers)
        self.events_path = events_path
        self.group_size = spec.rollout.group_size
        self.token_admission = spec.scheduler.enabled("token_admission")
        self.concurrency_control = spec.scheduler.enabled("concurrency_control")
        self.controller = ConcurrencyController.from_spec(spec)
        self.lengths = LengthEstimator(spec.rollout.longest_response, spec.scheduler.ewma_alpha)
        # The buffer's published version, as last read: picks the length stage.
        self.policy_version = 0
        initial_cap = spec.concurrency_cap
        if self.concurrency_control:
            initial_cap = min(max(initial_cap, self.controller.min_cap), self.controller.max_cap)
        # Routed to once its engine runs (a worker starts generating tens of
        # seconds after the job starts).
        self.loads = {name: WorkerLoad(name, initial_cap, routable=False) for name in workers}
        self._standby = set(standby or ())
        self._unready = set(workers) - self._standby
        # A worker that joined mid-job: routed to once its engine runs this version.
        self._min_version: dict[str, int] = {}
        self._events_epoch: dict[str, int] = {}
        self._ready_checked = -READY_POLL_S
        self._poll_s = BUDGET_POLL_S
        # Whether the last round ended with no group in hand because the buffer
        # refused budget (its bounds, not the workers' caps, held dispatch back).
        self.budget_refused = False
        # Algorithm 1's blocked time (paper §6.2): worker-seconds that routable
        # workers stood empty because the buffer's budget (B_max, δ, a sync under
        # way) granted nothing more, integrated over the rounds
        # (`blocked_worker_seconds`).
        self._blocked_worker_s = 0.0
        self._blocked_rate = 0.0
        self._blocked_since = clock.monotonic()
        # Per worker: the time, KV usage and preemption totals of its last stats.
        self._control_last: dict[str, tuple[float, float, int]] = {}
        self._prompts = task.prompts()
        self._next_prompt: Prompt | None = None  # drawn, not yet dispatched
        # ... and its group id if it had one (a group going out again), and whether
        # it is the stream's next.
        self._next_group: str | None = None
        self._next_from_stream = False
        self.ledger = ledger
        # Groups in flight when the job's services last went down (the ledger's):
        # routed again first, under their ids, on the budget they were granted.
        self._recovered: deque[tuple[str, Prompt]] = deque()
        self.recovered_groups = 0
        self._events_restart: set[str] = set()
        # Workers that left the job for good (an elastic job's lost worker).
        self._retired: set[str] = set()
        # Groups a worker leaving rollout handed back: routed again first, on the
        # budget they were granted (never acquired twice, never lost).
        self._returned: deque[Prompt] = deque()
        self.returned_groups = 0
        # Groups dynamic sampling dropped whose grants are in hand, not yet routed
        # again (each leaves the ledger with the route that spends its grant).
        self._filtered: deque[str] = deque()
        self.filtered_groups = 0
        self._groups: dict[str, _Group] = {}
        self._cond = threading.Condition()
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._granted = 0  # budget granted by the buffer, not yet routed
        self._encode_len: dict[str, int] = {}
        # Counters for metrics and tests.
        self.dispatched_groups: Counter[str] = Counter()
        self.rejections: Counter[str] = Counter()
        self.cap_changes: Counter[str] = Counter()
        # Algorithm 1's rebalance decisions (recorded by the scheduler), by reason;
        # those carried out with role flips; the flips, by direction.
        self.placement_recommendations: Counter[str] = Counter()
        self.rebalances: Counter[str] = Counter()
        self.role_flips: Counter[str] = Counter()
        self.error = ""

    # --- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        if self.ledger is not None:
            self._resume_from_ledger()
        targets = [("dispatch", self._dispatch_loop, ()), ("control", self._control_loop, ())]
        targets += [(f"events-{name}", self._event_loop, (name,)) for name in self.clients]
        for label, target, args in targets:
            thread = threading.Thread(target=self._guard, args=(target, args),
                                      name=f"dispatch-{self.job_id[:20]}-{label}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        with self._cond:
            self._cond.notify_all()
        for thread in self._threads:
            thread.join(timeout_s)

    def _resume_from_ledger(self) -> None:
        position, groups = self.ledger.load()
        for _ in range(position):
            next(self._prompts)
        with self._cond:
            self._recovered.extend(groups)
            self._granted += self.group_size * len(groups)
            self.recovered_groups = len(groups)
        if position or groups:
            self.record({"event": "dispatch_resumed", "stream_position": position,
                         "groups_in_flight": len(groups)})

    def _ledger_call(self, method: str, *args) -> None:
        """The ledger is bookkeeping for a later resume: a Redis error is logged
        and the dispatch goes on (the store's client retries transient ones)."""
        if self.ledger is None:
            return
        try:
            getattr(self.ledger, method)(*args)
        except Exception as err:  # noqa: BLE001 - a resume would re-route less exactly
            logger.warning("job %s: dispatch ledger %s failed: %s", self.job_id, method, err)

    def _guard(self, target, args) -> None:
        try:
            target(*args)
        except Unavailable as err:
            # The buffer (or a worker) stayed unreachable past its client's retries,
            # or its client was closed under this thread: expected, so one line.
            if self._stop.is_set():
                logger.info("job %s: dispatcher thread ended while stopping: %s",
                            self.job_id, err)
                return
            logger.error("job %s: dispatcher thread stopped: %s", self.job_id, err)
            self.error = f"{type(err).__name__}: {err}"
        except Exception as err:  # noqa: BLE001 - reported through snapshot(); the job watcher acts
            logger.exception("job %s: dispatcher thread failed", self.job_id)
            self.error = f"{type(err).__name__}: {err}"

    def snapshot(self) -> dict:
        """Caps, loads and counters, for metrics and the job's status."""
        with self._cond:
            return {
                "workers": {n: {"cap": w.cap, "inflight": w.inflight,
                                "predicted_tokens": round(w.predicted_tokens, 1),
                                "kv_budget_tokens": w.kv_budget_tokens,
                                "utilisation_ewma": w.utilisation_ewma,
                                "preemption_ewma": w.preemption_ewma,
                                "routable": w.routable}
                            for n, w in self.loads.items()},
                "dispatched_groups": dict(self.dispatched_groups),
                "admission_rejections": dict(self.rejections),
                "cap_changes": dict(self.cap_changes),
                "placement_recommendations": dict(self.placement_recommendations),
                "rebalances": dict(self.rebalances),
                "role_flips": dict(self.role_flips),
                "filtered_groups": self.filtered_groups,
                "predicted_response_tokens": self.lengths.predict(""),
                "error": self.error,
            }

    # --- the fast path ----------------------------------------------------------------

    def _check_ready(self) -> None:
        """Make workers whose engine now runs routable (at most every READY_POLL_S)."""
        now = self.clock.monotonic()
        if now - self._ready_checked < READY_POLL_S:
            return
        self._ready_checked = now
        for name in sorted(self._unready):
            try:
                stats = self.clients[name].stats(self.job_id)
            except Exception as err:  # noqa: BLE001 - not up yet
                logger.debug("job %s: %s not up yet: %s", self.job_id, name, err)
                continue
            if stats.state == "running" and (name not in self._min_version or
                                             stats.policy_version >= self._min_version[name]):
                with self._cond:
                    self._unready.discard(name)
                    self.loads[name].routable = True
                    self.loads[name].kv_budget_tokens = stats.kv_cache_tokens
                self.record({"event": "worker_ready", "worker": name,
                              "kv_budget_tokens": stats.kv_cache_tokens})

    def _dispatch_loop(self) -> None:
        while not self._stop.is_set():
            wait_s = self.dispatch_round()
            with self._cond:
                # A sample's end or a cap change wakes the loop at once; with a group
                # in hand that no worker can take, only they can change anything.
                self._cond.wait(wait_s)

    def dispatch_round(self) -> float:
        """One round of the dispatch loop: ready workers made routable, budget
        taken from the buffer for the room under the workers' caps, and every
        granted group routed that a worker admits. Returns the seconds to wait
        before the next round unless a sample's end or a cap change comes first."""
        if self._unready:
            self._check_ready()
        with self._cond:
            room = sum(max(0, w.cap - w.inflight) for w in self.loads.values() if w.routable)
            want = (room - self._granted) // self.group_size * self.group_size
            if self._granted < self.group_size and any(w.routable for w in self.loads.values()):
                # One group in hand even when every cap is full: it goes out the
                # moment a sample ends, and a cap that turns it away is the
                # controller's evidence that the cap, not the budget, binds.
                want = max(want, self.group_size)
        refused = short = False
        if want >= self.group_size:
            version = self.replay.stats(self.job_id).policy_version
            self.policy_version = version
            got = self.replay.acquire_dispatch(self.job_id, want, self.group_size,
                                               *self.spec.dispatch_limits(version))
            refused, short = got == 0, got < want
            with self._cond:
                self._granted += got
        unrouted = False
        while self._granted >= self.group_size and not self._stop.is_set():
            if not self._route_one():
                unrouted = True
                break
        self._poll_s = min(2 * self._poll_s, BUDGET_POLL_MAX_S) if refused else BUDGET_POLL_S
        with self._cond:
            self.budget_refused = refused and self._granted < self.group_size
            self._mark_blocked(short and self._granted < self.group_size)
        return ROUTE_RETRY_S if unrouted else self._poll_s

    def _mark_blocked(self, blocked: bool) -> None:
        """Close the blocked-time segment since the last round and open the next:
        while the buffer grants less than the room asks, each routable worker with
        nothing in flight counts as blocked. One below its cap but generating is
        not: an engine's decode throughput saturates well below a full batch (a
        step's cost is mostly the weights' read), so its free slots are not lost
        capacity. Called under the lock."""
        now = self.clock.monotonic()
        self._blocked_worker_s += self._blocked_rate * max(0.0, now - self._blocked_since)
        self._blocked_since = now
        self._blocked_rate = float(sum(1 for w in self.loads.values()
                                       if w.routable and w.inflight == 0)) if blocked else 0.0

    def blocked_worker_seconds(self) -> float:
        """Worker-seconds so far that rollout had room the buffer's budget held back
        (B_max, δ or a weight sync): Algorithm 1's blocked time (paper §6.2), which
        is not lost capacity. A worker still starting, or out of routing, counts
        for nothing."""
        with self._cond:
            open_s = max(0.0, self.clock.monotonic() - self._blocked_since)
            return self._blocked_worker_s + self._blocked_rate * open_s

    def _route_one(self) -> bool:
        prompt = self._peek_prompt()
        per_sample = self._prompt_tokens(prompt) + self.lengths.predict(prompt.text)
        with self._cond:
            result = route(list(self.loads.values()), self.group_size,
                           per_sample * self.group_size, self.spec.scheduler.admission_ratio,
                           self.token_admission)
            if result.worker is None:
                self.rejections[result.refused_by] += 1
                return False
            worker = result.worker
            group_id = self._next_group or self._new_group_id()
            from_stream = self._next_from_stream
            self._groups[group_id] = _Group(worker, prompt, per_sample, self.group_size)
            worker.inflight += self.group_size
            worker.predicted_tokens += per_sample * self.group_size
            self._granted -= self.group_size
            self._next_prompt, self._next_group, self._next_from_stream = None, None, False
            cap = worker.cap
            # The grant of a filtered group, if one is in hand, is the one spent here.
            replaces = self._filtered.popleft() if self._filtered else None
        # In the ledger before the worker has it: a fault after the submit finds it there.
        self._ledger_call("routed", group_id, prompt, from_stream, replaces)
        if self._submit(worker, group_id, prompt, cap):
            with self._cond:
                self.dispatched_groups[worker.name] += 1
            return True
        with self._cond:
            # Never reached the worker: the prompt and the grant go to another.
            self._groups.pop(group_id, None)
            worker.inflight -= self.group_size
            worker.predicted_tokens -= per_sample * self.group_size
            worker.routable = False
            self._granted += self.group_size
            # Out again under the same id (the ledger holds it), off the stream already.
            self._next_prompt, self._next_group, self._next_from_stream = prompt, group_id, False
        return any(w.routable for w in self.loads.values())

    def _peek_prompt(self) -> Prompt:
        if self._next_prompt is None:
            with self._cond:
                recovered = self._recovered.popleft() if self._recovered else None
                returned = self._returned.popleft() if self._returned and not recovered else None
            if recovered is not None:
                self._next_group, self._next_prompt = recovered
            elif returned is not None:
                self._next_prompt = returned
            else:
                self._next_prompt, self._next_from_stream = next(self._prompts), True
        return self._next_prompt

    def _prompt_tokens(self, prompt: Prompt) -> int:
        # Characters + 1 bound the token count of the byte-level tokenisers used
        # here from above; a worker's real count replaces it after its first sample.
        return self._encode_len.get(prompt.text, len(prompt.text) + 1)

    def _submit(self, worker: WorkerLoad, group_id: str, prompt: Prompt, cap: int) -> bool:
        client = self.clients[worker.name]
        # A length curriculum's stage at the published version (rollout.length_schedule).
        bounds = (self.spec.rollout.response_bounds(self.policy_version)
                  if self.spec.rollout.length_schedule else None)
        for attempt in range(SUBMIT_ATTEMPTS):
            try:
                client.submit_group(self.job_id, group_id, prompt, cap, bounds)
                return True
            except Exception as err:  # noqa: BLE001 - retried, then the worker leaves routing
                logger.warning("job %s: submit to %s failed (%s), attempt %d", self.job_id,
                               worker.name, err, attempt + 1)
                if self._stop.wait(SUBMIT_RETRY_S):
                    return False
        self.record({"event": "worker_unroutable", "worker": worker.name,
                      "reason": "submit failed"})
        return False

    # --- what the workers report ------------------------------------------------------

    def _event_loop(self, name: str) -> None:
        client, since, failures = self.clients[name], 0, 0
        # A worker given back and taken in again reads from a new thread (add_worker).
        epoch = self._events_epoch.get(name, 0)
        while (not self._stop.is_set() and name not in self._retired
               and self._events_epoch.get(name, 0) == epoch):
            if name in self._events_restart:
                with self._cond:
                    self._events_restart.discard(name)
                since = 0
            try:
                events = client.wait_events(self.job_id, since, EVENT_WAIT_S)
                failures = 0
            except Exception as err:  # noqa: BLE001 - the watcher fails a dead worker's job
                failures += 1
                if failures in (1, 10) or failures % 100 == 0:
                    logger.warning("job %s: events from %s: %s", self.job_id, name, err)
                self._stop.wait(min(2.0, 0.1 * failures))
                continue
            if events:
                since = events[-1].seq
                self.apply_events(events)

    def apply_events(self, events: list[SampleEvent]) -> None:
        """What a worker reported: each ended sample frees its slot and teaches the
        length estimator; a group's end frees what did not end, and a group handed
        back goes out again on its grant."""
        ended: list[str] = []
        with self._cond:
            for e in events:
                group = self._groups.get(e.group_id)
                if group is None:
                    continue
                worker = group.worker
                if e.sample_index >= 0:
                    group.remaining -= 1
                    worker.inflight -= 1
                    worker.predicted_tokens -= group.tokens_per_sample
                    self.lengths.observe(group.prompt.text, e.response_tokens)
                    if e.prompt_tokens:
                        self._encode_len[group.prompt.text] = e.prompt_tokens
                        if len(self._encode_len) > 100_000:
                            self._encode_len.clear()
                    continue
                # The group was put (or failed): what did not end is freed with it.
                self._groups.pop(e.group_id)
                worker.inflight -= group.remaining
                worker.predicted_tokens -= group.tokens_per_sample * group.remaining
                worker.predicted_tokens = max(0.0, worker.predicted_tokens)
                if e.error == GROUP_FILTERED:
                    # Dropped by dynamic sampling: a new prompt goes out on its grant,
                    # and it stays in the ledger until then (see the module docstring).
                    self._filtered.append(e.group_id)
                    self._granted += self.group_size
                    self.filtered_groups += 1
                    continue
                ended.append(e.group_id)
                if e.error == GROUP_RETURNED:
                    # Handed back unfinished (its worker left rollout): the prompt goes
                    # out again, on the grant it had.
                    self._returned.append(group.prompt)
                    self._granted += self.group_size
                    self.returned_groups += 1
                elif e.error:
                    self.record({"event": "group_failed", "worker": worker.name,
                                  "group_id": e.group_id, "error": e.error[:500]})
            self._cond.notify_all()
        self._ledger_call("ended", ended)

    # --- the slow loop ----------------------------------------------------------------

    def _control_loop(self) -> None:
        while not self._stop.wait(self.spec.scheduler.control_interval_s):
            self.control_round()

    def control_round(self) -> None:
        """One tick of the slow loop: each worker's KV-cache budget, and its
        concurrency cap moved on its KV utilisation and preemptions since the
        last tick (generation.ConcurrencyController, paper §6.1)."""
        for name, client in self.clients.items():
            try:
                stats = client.stats(self.job_id)
            except Exception as err:  # noqa: BLE001 - next tick
                logger.debug("job %s: no stats from %s: %s", self.job_id, name, err)
                continue
            now = self.clock.monotonic()
            prev = self._control_last.get(name)
            self._control_last[name] = (now, stats.kv_usage_seconds_total,
                                        stats.preempted_requests_total)
            with self._cond:
                worker = self.loads[name]
                worker.kv_budget_tokens = stats.kv_cache_tokens
                if prev is None or not self.concurrency_control:
                    continue
                utilisation = (stats.kv_usage_seconds_total - prev[1]) / max(now - prev[0], 1e-6)
                decision = self.controller.update(
                    worker, utilisation, stats.preempted_requests_total - prev[2])
                if decision.reason != "hold":
                    self.cap_changes[decision.reason] += 1
                    self._cond.notify_all()
            if decision.reason != "hold":
                self.record(decision.as_event())

    def record(self, event: dict) -> None:
        event = {"time": round(self.clock.time(), 3), "job_id": self.job_id, **event}
        logger.info("scheduling decision %s", json.dumps(event))
        if self.events_path is not None:
            try:
                with self.events_path.open("a") as f:
                    f.write(json.dumps(event) + "\n")
            except OSError as err:
                logger.warning("job %s: cannot record a decision: %s", self.job_id, err)
