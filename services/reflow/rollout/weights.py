"""The rollout worker's side of weight sync (paper §4.1 step 4): joining the
trainer's broadcast group and loading each published policy version.

State machine: none -> initialising -> ready; one update at a time, versions
strictly in order. A restarted trainer (its predecessor died, the job goes on
from a checkpoint) builds a new group on a new port: a join naming another
address than the one joined is a re-join, and the first update after it may
skip versions (the resumed trainer publishes above every version seen, so
versions keep rising). A broadcast that fails part-way (its sender died)
leaves the engine paused, never generating with half-loaded weights, until a
re-joined trainer sends a whole version.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time

from reflow.core.errors import FailedPrecondition
from reflow.core.paths import check_host
from reflow.rollout.engine import WeightSyncSpec
from reflow.rollout.records import WeightUpdate

logger = logging.getLogger(__name__)

# How long after a weight update the engine's preemptions are the update's.
SYNC_PREEMPTION_WINDOW_S = 0.25
# A re-join waits this long for the update its dead trainer left in progress to fail.
PENDING_UPDATE_WAIT_S = 120.0
_DRAIN_TICK_S = 0.005


class WeightSyncMixin:
    """Weight-sync methods of `RolloutWorker` (rollout/worker.py), which holds the
    state they use (`_sync_lock`, `_sync_state`, `_init`, `_update`,
    `_sync_address`, `_rejoined`, the engine and the worker loop)."""

    async def _label_weights(self, policy_version: int) -> None:
        label = getattr(self.engine, "label_weights", None)
        if label is not None:
            await label(policy_version)

    def set_sync_place(self, rank: int, world_size: int, trainer_host: str = "") -> None:
        """This worker's place in the job's weight-sync group from now on (paper
        §4.1 step 4's rank plan over the engines in the job): another worker of
        the job was lost or given back and the group shrinks (this engine's rank
        falls by the engines lost below it), or a new engine joins after the last
        one and the group grows (the rank stays). The group set up now keeps its
        ranks; the trainer's next one, which it builds at its next publish, is
        checked against this place. A rank never rises: engines join at the end.
        `trainer_host`: the trainer came back at another IP (its pod recreated),
        and its next group is set up there; empty leaves it (and rank and
        world_size 0 leave the place)."""
        tp = self.spec.rollout.tensor_parallel_size
        with self._sync_lock:
            if trainer_host and trainer_host != self.trainer_host:
                check_host(trainer_host, "trainer_host")
                logger.warning("job %s: the trainer's weight-sync host %s -> %s (its pod came "
                               "back at another address)", self.job_id, self.trainer_host,
                               trainer_host)
                self.trainer_host = trainer_host
            if (rank, world_size) in ((0, 0), (self.sync_rank, self.sync_world_size)):
                return  # the host alone (0/0), a retry, or the same place
            if not 1 <= rank <= world_size - tp:
                raise ValueError(f"rank: {rank} with tensor_parallel_size {tp} does not fit in "
                                 f"world_size {world_size}; need 1 <= rank and rank + "
                                 "tensor_parallel_size <= world_size")
            if rank > self.sync_rank or (rank < self.sync_rank
                                         and world_size >= self.sync_world_size):
                raise ValueError(f"rank/world_size: {rank}/{world_size} does not follow this "
                                 f"worker's place {self.sync_rank}/{self.sync_world_size}; a "
                                 "rank only falls, as engines below it leave, and new engines "
                                 "join after the last")
            logger.warning("job %s: weight-sync place %d/%d -> %d/%d (the job's engines "
                           "changed)", self.job_id, self.sync_rank, self.sync_world_size, rank,
                           world_size)
            self.sync_rank, self.sync_world_size = rank, world_size

    def init_weight_sync(self, spec: WeightSyncSpec, timeout_s: float = 600.0) -> None:
        """Join the job's weight-sync group. Refused unless `spec` names this
        worker's place in the group; a second join of the same group is refused, a
        join of a new one (a restarted trainer's) replaces it. Waits at most
        `timeout_s` (the caller's deadline); the join itself goes on, on the worker
        loop, and a retry joins it."""
        with self._sync_lock:
            address = (spec.master_address, spec.master_port)
            # Checked first: a join that does not describe this worker's place never
            # unsets the group it has.
            spec.check(self.sync_rank, self.sync_world_size, self.trainer_host,
                       self.spec.rollout.tensor_parallel_size)
            if self._sync_state == "ready":
                if address == self._sync_address:
                    raise FailedPrecondition("weight sync is already set up with this trainer; "
                                             "it is set up once per trainer")
                logger.warning("job %s: re-joining weight sync at %s:%d (a restarted trainer)",
                               self.job_id, *address)
                self._sync_state = "none"
            if self._sync_state == "none":
                self._sync_state = "initialising"
                self._init = concurrent.futures.Future()
                threading.Thread(target=self._init_weight_sync, args=(spec, self._init),
                                 name="wsync-init", daemon=True).start()
            pending = self._init
        try:
            pending.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"weight-sync set-up not done within {timeout_s:.0f}s; "
                               "it goes on, and a retry waits for it") from None

    def _init_weight_sync(self, spec: WeightSyncSpec, done: concurrent.futures.Future) -> None:
        try:
            self.wait_ready(600.0)
            update = self._update
            if update is not None and not update[1].done():
                # The dead trainer's broadcast: it fails once its sender's socket is gone.
                try:
                    update[1].result(PENDING_UPDATE_WAIT_S)
                except Exception as err:  # noqa: BLE001 - expected: the sender died
                    logger.info("job %s: the interrupted update ended: %s", self.job_id, err)
            self.call(self.engine.init_weight_sync(spec), 600.0)
        except BaseException as err:  # noqa: BLE001 - handed to every waiter
            with self._sync_lock:
                self._sync_state = "none"
            done.set_exception(err)
            return
        with self._sync_lock:
            self._sync_state = "ready"
            self._sync_address = (spec.master_address, spec.master_port)
            # A resumed trainer's first version may follow (update_weights' resync).
            self._rejoined = True
        done.set_result(None)

    def update_weights(self, policy_version: int, timeout_s: float = 600.0,
                       resync: bool = False) -> WeightUpdate:
        """Load policy version `policy_version`, which must be the next one (with
        `resync`, as the first update after a join: any later one). A call for the version already being loaded joins
        that update (a retried or early call waits for the trainer's broadcast
        instead of starting a second one); any other version is refused at once.
        Waits at most `timeout_s`; the update goes on."""
        with self._sync_lock:
            if self._sync_state != "ready":
                raise FailedPrecondition("weight sync is not set up for this job; "
                                         "InitWeightSync comes first")
            if self.state == "failed":
                raise FailedPrecondition(f"this rollout worker has failed: {self.error}")
            current = self.counters.policy_version
            next_ok = (policy_version > current if resync and self._rejoined
                       else policy_version == current + 1)
            if self._update is not None and not self._update[1].done():
                version, future = self._update
                if version != policy_version:
                    raise FailedPrecondition(f"policy_version: {policy_version} while the "
                                             f"update to {version} is in progress")
            elif not next_ok:
                # After a join the trainer's broadcast is on the new group: a version
                # received on the old one is no retry of it, and answering as if it
                # were would leave the new broadcast waiting for this engine.
                if (policy_version == current and self._update is not None
                        and self._update[0] == current and not self._rejoined):
                    future = self._update[1]  # a retry of the update just done
                else:
                    raise FailedPrecondition(
                        f"policy_version: {policy_version} is not the next version "
                        f"({current + 1})"
                        + ("; a resync comes first after a join" if resync and not self._rejoined
                           else f"; a resync must be above the version held (v{current})"
                           if resync else ""))
            else:
                self._rejoined = False
                future = asyncio.run_coroutine_threadsafe(
                    self._update_weights(policy_version), self._loop)
                self._update = (policy_version, future)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"weight update to v{policy_version} not done within "
                               f"{timeout_s:.1f}s; it goes on, and a retry waits for it") from None

    async def _update_weights(self, policy_version: int) -> WeightUpdate:
        # Partial rollout (paper §4.1 step 4): in-flight requests stop at a token
        # boundary and are kept; tokens sampled after the pause belong to the new
        # version (the engine's label where it keeps them, else their arrival).
        t0 = time.perf_counter()
        self._resumed.clear()
        if not self.spec.rollout.partial_rollout:
            # Whole samples under one version (verl one_step_off): admit nothing more
            # and let what is in flight finish under the old weights first.
            # Only samples that started: a group submitted meanwhile waits for the
            # update (on _resumed) and would never finish under the old weights.
            # The engine is not paused yet: what it decodes meanwhile is busy time.
            while self._generating > 0 and not self._stopping:
                await asyncio.sleep(_DRAIN_TICK_S)
        self._paused = True
        await self.engine.pause()
        # An engine without labels: let its output handler hand over the tokens
        # generated before the pause.
        await asyncio.sleep(0)
        t1 = time.perf_counter()
        try:
            receive_s = await self.engine.receive_weights()
            await self._label_weights(policy_version)
        except Exception as err:
            # Half-loaded or mislabelled weights must not generate: stay paused. The
            # trainer sees this error and fails the job; if the trainer is what died,
            # its restarted successor re-joins and sends a whole version.
            self.error = (f"weight update to v{policy_version}: {err}; paused until a "
                          "trainer re-joins")
            logger.error("job %s: %s", self.job_id, self.error)
            raise
        self.counters.policy_version = policy_version
        self.error = ""
        await self.engine.resume()
        self._sync_preemption_until = time.monotonic() + SYNC_PREEMPTION_WINDOW_S
        self._paused = False
        self._resumed.set()
        logger.info(
            "job %s: policy version %d loaded (pause %.3fs, receive %.3fs)",
            self.job_id, policy_version, t1 - t0, receive_s,
        )
        return WeightUpdate(pause_s=t1 - t0, receive_s=receive_s)
