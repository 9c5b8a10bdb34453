"""A fixed-role job's range of rollout workers (cluster.min_rollout_workers to
cluster.max_rollout_workers): it grows into free workers while no other job
waits for any, and gives workers back, down to its minimum, while one does.

Growth (a worker freed by another job, a pod that became ready): the backend
claims a free worker for the job (`claim_rollout`); its engine starts at the
next rank of the weight-sync group (weightsync.RankPlan: new engines join after
the last), every engine already in the job is told the larger group's size
(Rollout.SetSyncPlace, its rank unchanged), the trainer is told the new engine
set, and at its next publish it builds the larger group and sends the current
version whole. The dispatcher routes to the new engine once it runs that
version (its samples would only be evicted as stale before).

Give-back (another job found too few free workers): the last engine leaves (the
others keep their ranks): its groups in flight go out again to the others (the
dispatcher's worker_retired), the others are told the smaller group's size, the
trainer the engine set without it. Once the trainer has published over the
smaller group (or GIVE_BACK_WAIT_S passed), the engine stops the job and the
worker is released to the queue. Queue order stays first come, first placed:
a job grows only while no job waits, so growth never takes a worker a queued
job could have had.
"""

from __future__ import annotations

import logging
import time

from reflow.weightsync import RankPlan

logger = logging.getLogger(__name__)

# How often a job below its maximum looks for a free worker.
GROW_EVERY_S = 5.0
# How long a worker given back may wait for the trainer's publish over the
# smaller group before it stops the job anyway (a publish to it then fails once
# and the trainer rebuilds the group, as for a lost worker).
GIVE_BACK_WAIT_S = 300.0


class RolloutResizer:
    """Resizes one job's rollout workers, from the job's watch loop (the thread
    that also runs its recoveries, so a resize never overlaps one)."""

    def __init__(self, record, spec, backend, placement, dispatcher, trainer,
                 rollouts: list, start_rollout, new_client, queue, events=None) -> None:
        """`rollouts`: the job's rollout clients in rank order (the list the job's
        closures share: grown and shrunk in place); `start_rollout(i)`: starts the
        job on rollout worker i; `new_client(address)`: a rollout client; `queue`:
        the scheduler's PlacementQueue; `events(dict)`: the job's event log."""
        self.record, self.spec, self.backend = record, spec, backend
        self.placement, self.dispatcher, self.trainer = placement, dispatcher, trainer
        self.rollouts, self.start_rollout, self.new_client = rollouts, start_rollout, new_client
        self.queue = queue
        self.events = events or (lambda event: None)
        low, high = spec.cluster.rollout_range or (len(rollouts), len(rollouts))
        cap = getattr(getattr(backend, "settings", None), "max_rollout_workers", 0) or high
        self.low, self.high = low, max(low, min(high, cap))
        self._next_look = 0.0
        # A worker given back, waiting for the trainer's publish over the smaller
        # group: (address, what the backend needs to release it, version, since).
        self._leaving: tuple[str, object, int, float] | None = None

    @staticmethod
    def wanted(spec, backend) -> bool:
        """Whether a job resizes: it has a range and its backend can claim workers."""
        return (spec.cluster.rollout_range is not None
                and getattr(backend, "claim_rollout", None) is not None)

    def tick(self, policy_version: int) -> None:
        """One look, after a poll of the trainer (`policy_version`: what it has
        published): finish a give-back under way, give one back while a job
        starves, or grow by one while none waits. A resize that fails is logged
        and tried again later: it never fails the job, which runs on as it is."""
        try:
            self._tick(policy_version)
        except Exception as err:  # noqa: BLE001 - the job runs on with the workers it has
            logger.warning("job %s: resizing its rollout workers failed: %s: %s",
                           self.record.job_id, type(err).__name__, err)
            self._next_look = time.monotonic() + GROW_EVERY_S

    def _tick(self, policy_version: int) -> None:
        if self._leaving is not None:
            self._finish_give_back(policy_version)
            return
        starved = [j for j in self.queue.starved() if j != self.record.job_id]
        if starved and len(self.rollouts) > self.low:
            self._give_back(policy_version, starved[0])
            return
        now = time.monotonic()
        if (len(self.rollouts) >= self.high or self.queue.waiting() or now < self._next_look):
            return
        self._next_look = now + GROW_EVERY_S
        self._grow()

    # --- growth ------------------------------------------------------------------------

    def _grow(self) -> None:
        started = time.monotonic()
        try:
            address = self.backend.claim_rollout(self.placement)
        except Exception as err:  # noqa: BLE001 - the job runs on as it is; next look later
            logger.warning("job %s: no rollout worker claimed to grow into: %s: %s",
                           self.record.job_id, type(err).__name__, err)
            return
        if address is None:
            return
        index = len(self.rollouts)
        client = self.new_client(address)
        self.rollouts.append(client)
        plan = self._plan()
        try:
            self.start_rollout(index)
            self._tell_places(plan, skip=address)
        except Exception as err:  # noqa: BLE001 - the claim is undone; the job runs on
            logger.warning("job %s: rollout worker %s did not join: %s: %s; released",
                           self.record.job_id, address, type(err).__name__, err)
            self.rollouts.pop()
            self._tell_places(self._plan(), best_effort=True)
            self.backend.release_detached(self.placement,
                                          self.backend.detach_rollout(self.placement, address))
            client.close()
            return
        self.dispatcher.add_worker(address, client)
        self._tell_trainer()
        self._recorded({"event": "rollout_worker_joined", "address": address,
                        "rank": plan.first_rank(index), "rollout_workers": len(self.rollouts),
                        "join_s": round(time.monotonic() - started, 3)})

    # --- give-back ---------------------------------------------------------------------

    def _give_back(self, policy_version: int, waiting_job: str) -> None:
        client = self.rollouts.pop()
        address = client.address
        rerouted = self.dispatcher.worker_retired(address)
        detached = self.backend.detach_rollout(self.placement, address)
        self._tell_places(self._plan(), best_effort=True)
        self._tell_trainer()
        self._leaving = (address, (client, detached), policy_version, time.monotonic())
        self._recorded({"event": "rollout_worker_leaving", "address": address,
                        "for_job": waiting_job, "groups_rerouted": rerouted,
                        "rollout_workers": len(self.rollouts)})

    def _finish_give_back(self, policy_version: int) -> None:
        address, (client, detached), version, since = self._leaving
        waited = time.monotonic() - since
        if policy_version <= version and waited < GIVE_BACK_WAIT_S:
            return  # the trainer has not published over the smaller group yet
        self._leaving = None
        try:
            client.stop_job(self.record.job_id)
        except Exception as err:  # noqa: BLE001 - released anyway: the next job's start resets it
            logger.warning("job %s: rollout worker %s given back without a stop: %s",
                           self.record.job_id, address, err)
        finally:
            client.close()
        self.backend.release_detached(self.placement, detached)
        self.queue.notify()
        self._recorded({"event": "rollout_worker_given_back", "address": address,
                        "waited_for_publish_s": round(waited, 3)})

    def release_leaving(self) -> None:
        """The job ends with a give-back under way: release that worker too."""
        if self._leaving is not None:
            _, (client, detached), _, _ = self._leaving
            self._leaving = None
            client.close()
            self.backend.release_detached(self.placement, detached)

    # --- helpers -----------------------------------------------------------------------

    def _plan(self) -> RankPlan:
        return RankPlan.for_engines([self.spec.rollout.tensor_parallel_size] * len(self.rollouts))

    def _tell_places(self, plan: RankPlan, skip: str = "", best_effort: bool = False) -> None:
        """Every engine's place in the group of `plan` (ranks unchanged, the size new)."""
        for i, client in enumerate(self.rollouts):
            if client.address == skip:
                continue
            try:
                client.set_sync_place(self.record.job_id, plan.first_rank(i), plan.world_size)
            except Exception as err:  # noqa: BLE001 - with best_effort its next join fails
                if not best_effort:
                    raise
                logger.warning("job %s: engine %s not told its place %d/%d: %s",
                               self.record.job_id, client.address, plan.first_rank(i),
                               plan.world_size, err)

    def _tell_trainer(self) -> None:
        """The trainer's engines from now on. A trainer that cannot take them (it is
        being restarted) starts with the placement's, which are these."""
        try:
            self.trainer.reconfigure(self.record.job_id, None,
                                     rollout_addresses=[c.address for c in self.rollouts])
        except Exception as err:  # noqa: BLE001 - a restarted trainer reads the placement
            logger.warning("job %s: the trainer was not told its engines now: %s: %s",
                           self.record.job_id, type(err).__name__, err)

    def _recorded(self, event: dict) -> None:
        self.events(event)
        logger.info("job %s: %s", self.record.job_id, event)
