"""The trainer's side of weight sync (paper §4.1 step 4): the broadcast group
with every rollout engine, publishing each policy version, and keeping both
going when a rollout worker is replaced.

A rollout worker that died takes its rank of the group with it: the next
publish fails at its update call (unreachable, or a fresh process that has not
joined). The trainer then waits for every worker of the job to generate again
(the job controller restarts the dead one), builds a new group on a new port,
which the survivors re-join (rollout/weights.py), and publishes its weights as
a resync, so the new worker, started from model.path, holds the trained ones.
"""

from __future__ import annotations

import concurrent.futures
import logging
import time

import torch

from reflow.core.errors import VersionGap
from reflow.procs import free_port
from reflow.rollout.engine import WeightSyncSpec
from reflow.trainer.sync_check import (DEFAULT_TOLERANCE, WeightSyncMismatch, check_engine,
                                       trainer_probe_logprobs)
from reflow.weightsync import (DEFAULT_BUCKET_BYTES, RankPlan, cuda_device_uuid, make_group,
                               new_rendezvous_key, send_weights, specs_of)

logger = logging.getLogger(__name__)

# How long a rebuild waits for the replaced worker's engine to run again.
ENGINE_RETURN_TIMEOUT_S = 600.0
# How long one engine may take to score the sync check's probe: it waits behind
# the recomputation of every request the sync paused.
PROBE_DEADLINE_S = 300.0


def publish_to_buffer(replay, job_id: str, version: int) -> int:
    """Tell the replay buffer the job's policy version. The buffer moves one version
    at a time (ReplayStore.publish_version: a single call cannot jump it), and may
    be behind for good reasons: a resumed trainer publishes above every version
    an engine holds, and engines may be ahead of the buffer; a Redis under
    `appendfsync everysec` that crashed lost up to a second of publishes. On its
    refusal the trainer, which holds `version`, walks the buffer up through each
    version between, each evicting by δ as a publish does. Returns how many
    versions the buffer was behind (0: it took `version` at once)."""
    try:
        replay.publish_version(job_id, version)
        return 0
    except VersionGap as err:
        current = replay.stats(job_id).policy_version
        logger.warning("job %s: the replay buffer is at v%d, %d versions behind v%d (%s); "
                       "publishing each version up to it", job_id, current,
                       version - 1 - current, version, err)
    for step in range(current + 1, version + 1):
        replay.publish_version(job_id, step)
    return max(0, version - 1 - current)


# How long a rebuild waits for the failed publish's sender to end its part.
SENDER_WAIT_S = 120.0


class WeightPublisher:
    """Weight-sync methods of `TrainLoop` (trainer/loop.py), which holds the state
    they use (`rollouts`, `_pool`, `_sync_group`, `policy_version`, the model)."""

    def init_weight_sync(self) -> None:
        """Build the broadcast group: trainer rank 0, then each rollout engine's
        tensor-parallel workers in turn (weightsync.RankPlan; with TP 1 engine i is
        rank i+1). Each build draws a new rendezvous key, handed to the engines in
        the authenticated InitWeightSync (weightsync.make_group)."""
        named = self._named_weights()
        self.sync_bytes = sum(s.nbytes for s in specs_of(named))
        backend = "nccl" if self.device.type == "cuda" else "gloo"
        port, key = free_port(), new_rendezvous_key()
        tp = self.spec.rollout.tensor_parallel_size
        plan = RankPlan.for_engines([tp] * len(self.rollouts))
        world = plan.world_size
        tensors = [(s.name, list(s.shape), s.dtype) for s in specs_of(named)]
        # On nccl an engine on the trainer's own GPU refuses to join (weightsync).
        device_uuid = cuda_device_uuid(self.device) if backend == "nccl" else ""
        futures = [
            self._pool.submit(
                client.init_weight_sync,
                self.job_id,
                WeightSyncSpec(self.master_address, port, plan.first_rank(i), world, backend,
                               tensors, DEFAULT_BUCKET_BYTES, tp, device_uuid, key),
            )
            for i, client in enumerate(self.rollouts)
        ]
        self._sync_group = make_group(self.master_address, port, 0, world, backend,
                                      rendezvous_key=key)
        for f in futures:
            f.result()
        logger.info("job %s: weight sync group ready (%s, %d ranks)", self.job_id, backend, world)

    def _resync_engines(self) -> None:
        """After a resume (or a restart before any checkpoint) the engines hold
        other weights (a newer version of the trainer that died, or model.path
        after a whole-job restart): publish the
        resumed weights at once, as a version above every one seen so far, so
        versions keep rising and δ keeps meaning what it says."""
        seen = [self.policy_version, self.replay.stats(self.job_id).policy_version]
        seen += [c.stats(self.job_id).policy_version for c in self.rollouts]
        if self.resume_from is None and max(seen) == self.policy_version:
            return  # a fresh job: every engine holds model.path, version 0
        self.policy_version = max(seen)
        sync_s, _ = self._publish(resync=True)
        logger.info("job %s: engines re-synced to the resumed weights as version %d (%.2fs)",
                    self.job_id, self.policy_version, sync_s)

    def _publish(self, resync: bool = False) -> tuple[float, float]:
        """Send the weights to every rollout worker as version v+1, then tell the buffer
        (`resync`: the first version of a resumed trainer, which may lie several
        versions past the buffer's: `publish_to_buffer` walks it up).
        Returns the seconds it took, and how many of them the slowest worker spent
        pausing: the trainer's send waits for that, so it is trainer idle time (with
        partial rollout off, as verl's one_step_off, the pause lets the samples in
        flight finish under the old weights)."""
        t0 = time.monotonic()
        # The previous version's check first: a mismatch fails the job here.
        self.finish_engine_check()
        version = self.policy_version + 1
        futures = [
            self._pool.submit(client.update_weights, self.job_id, version,
                              **({"resync": True} if resync else {}))
            for client in self.rollouts
        ]
        sender = self._last_sender = self._pool.submit(self._send_weights)
        # A worker that refuses the version (or has died) never joins the broadcast,
        # which would then wait out the group's timeout: fail at its refusal instead.
        done, _ = concurrent.futures.wait([sender, *futures],
                                          return_when=concurrent.futures.FIRST_EXCEPTION)
        for f in done:
            if f.exception() is not None:
                raise f.exception()
        sender.result()
        updates = [f.result() for f in futures]
        self.policy_version = version
        self._start_engine_check()
        publish_to_buffer(self.replay, self.job_id, version)
        return time.monotonic() - t0, max((u.pause_s for u in updates), default=0.0)

    def _send_weights(self) -> None:
        if self.root is not None:
            # Every rank gathers each bucket from the shards; this leader sends it.
            from reflow.trainer.fsdp import send_sharded_weights

            self.group.send_command("publish", self.step)
            send_sharded_weights(self.root, self._sync_group, DEFAULT_BUCKET_BYTES)
            self._probe_expected = self.probe_expected()
            return
        with torch.no_grad():
            send_weights(self._sync_group, self._named_weights())
        self._probe_expected = self.probe_expected()

    # --- the check that the engines hold what was published (sync_check.py) ----

    def probe_expected(self) -> list[float] | None:
        """The probe's log-probabilities under the trainer's policy (None with
        rollout.sync_check off). Every rank of an FSDP group calls it together."""
        if not self.spec.rollout.sync_check:
            return None
        from reflow.trainer.fsdp import root_device

        device = root_device(self.root) if self.root is not None else self.device
        return trainer_probe_logprobs(self.trained, self.probe_ids, device,
                                      self.spec.trainer.logprob_chunk_tokens)

    def check_engines(self, version: int, expected: list[float]) -> None:
        """Every engine's probe against the trainer's (`expected`, scored under
        `version`). Raises WeightSyncMismatch, which fails the job. An engine that
        cannot answer (it died, or stands by asleep) is not checked: its
        replacement is re-synced and checked like any engine."""
        tolerance = (self.spec.rollout.sync_check_tolerance
                     or DEFAULT_TOLERANCE[self.spec.model.dtype])
        futures = [(c, self._check_pool.submit(c.score_tokens, self.job_id, self.probe_ids,
                                               PROBE_DEADLINE_S))
                   for c in self.rollouts]
        worst = 0.0
        for client, future in futures:
            try:
                engine_version, got = future.result()
            except Exception as err:  # noqa: BLE001 - a lost engine is the rebuild's to handle
                logger.warning("job %s: v%d not checked on rollout engine %s (%s: %s)",
                               self.job_id, version, client.address, type(err).__name__, err)
                continue
            worst = max(worst, check_engine(client.address, version, engine_version,
                                            expected, got, tolerance, self.spec.lora is not None))
        self.last_sync_check = worst
        logger.debug("job %s: v%d: engines match the trainer (mean |Δ log-prob| <= %.2g)",
                     self.job_id, version, worst)

    def _start_engine_check(self) -> None:
        """Check the version just published beside training, not in the trainer's
        way: after a sync each engine first recomputes the KV cache of the requests
        it paused (partial rollout), and the probe waits behind them (15 s of a
        SmolLM2 engine's time, measured). The next publish, or the end of the
        job, takes the result (`finish_engine_check`)."""
        if not self.spec.rollout.sync_check or not self.rollouts:
            return
        self.finish_engine_check()
        self._engine_check = self._check_pool.submit(
            self.check_engines, self.policy_version, self._probe_expected)

    def finish_engine_check(self) -> None:
        """Wait for the last version's check; raises its WeightSyncMismatch."""
        check, self._engine_check = self._engine_check, None
        if check is not None:
            check.result()

    def check_engines_at_start(self) -> None:
        """The engines against the trainer before the first step: what they loaded
        from model.path (and a resumed job's resync) is the policy the trainer holds."""
        if not self.spec.rollout.sync_check or not self.rollouts:
            return
        if self.root is not None:
            self.group.send_command("probe", self.step)
        self.check_engines(self.policy_version, self.probe_expected())

    def _publish_or_rebuild(self) -> tuple[float, float]:
        """`_publish`, and when a rollout worker's update fails, rebuild the group
        once the job's workers run again and publish as a resync (bounded by
        cluster.max_restarts within cluster.restart_window_s). Engines that left the job since the last
        publish (a lost worker's, one given back) or joined it (a replacement, a job that
        grew) take a rebuild first (trainer/membership.py set_engines)."""
        self._apply_engines()
        if self._engines_changed:
            return self._rebuild_weight_sync("the job's rollout engines changed",
                                             counted=False)
        try:
            return self._publish()
        except WeightSyncMismatch:
            raise  # the engine loaded what it was sent, wrongly: a rebuild would too
        except Exception as err:  # noqa: BLE001 - classified below
            if self.stopping or self._rebuilds_spent():
                raise
            reason = f"publishing v{self.policy_version + 1} failed ({type(err).__name__}: {err})"
        return self._rebuild_weight_sync(reason)

    def _rebuilds_spent(self) -> bool:
        return self.spec.cluster.restart_budget().spent(self.weight_sync_rebuild_times,
                                                        time.time())

    def resync_replaced_engines(self) -> None:
        """While the trainer waits for a batch: an engine that runs a version below
        the published one is a replaced worker, started from model.path. Its
        samples would be evicted as stale on arrival and the trainer would wait
        forever, so it gets the trained weights now, not at the next step."""
        if self._sync_group is None or self._rebuilds_spent():
            return
        behind = []
        for c in self.rollouts:
            s = self._rollout_stats(c)
            if s is not None and s.state == "running" and s.policy_version < self.policy_version:
                behind.append(f"{c.address} at v{s.policy_version}")
        if behind:
            self._rebuild_weight_sync(f"replaced rollout workers behind v{self.policy_version}: "
                                      + ", ".join(behind))

    def _rebuild_weight_sync(self, reason: str, counted: bool = True) -> tuple[float, float]:
        """`counted`: against cluster.max_restarts (a failed publish's rebuild; one
        for a lost worker's engine is bounded by the workers the job has)."""
        logger.warning("job %s: %s; rebuilding weight sync", self.job_id, reason)
        started = time.monotonic()
        self.weight_sync_rebuilds += int(counted)
        if counted:
            self.weight_sync_rebuild_times.append(time.time())
        # First: a surviving engine still blocked receiving the broadcast that failed
        # fails now, and is free to join the new group.
        if self._sync_group is not None:
            self._sync_group.abort()
            self._sync_group = None
        sender = getattr(self, "_last_sender", None)
        if sender is not None:
            # The failed publish's sender ends its part before the next publish's
            # collectives begin: an FSDP group's ranks gather to the last bucket.
            done, _ = concurrent.futures.wait([sender], timeout=SENDER_WAIT_S)
            if not done:
                logger.warning("job %s: the failed publish's sender is still busy after "
                               "%.0fs", self.job_id, SENDER_WAIT_S)
        self._wait_engines_running()
        self._engines_changed = False
        self.init_weight_sync()
        # The failed publish may have reached some engines: the resync goes above
        # every version any of them (or the buffer) holds, so that versions rise.
        self.policy_version = max([self.policy_version,
                                   self.replay.stats(self.job_id).policy_version]
                                  + [c.stats(self.job_id).policy_version for c in self.rollouts])
        _, wait_s = self._publish(resync=True)
        logger.info("job %s: weight sync rebuilt, v%d published in %.1fs", self.job_id,
                    self.policy_version, time.monotonic() - started)
        return time.monotonic() - started, wait_s

    def _wait_engines_running(self) -> None:
        deadline = time.monotonic() + ENGINE_RETURN_TIMEOUT_S
        while True:
            # A lost worker's engine leaves the set once the scheduler says so.
            self._apply_engines()
            states = {}
            for c in self.rollouts:
                try:
                    states[c.address] = c.stats(self.job_id).state
                except Exception as err:  # noqa: BLE001 - not back yet
                    states[c.address] = f"unreachable ({type(err).__name__})"
            if all(s in ("running", "standby") for s in states.values()):
                return
            if self.stopping:
                raise RuntimeError("stopped while waiting for the rollout workers")
            if time.monotonic() > deadline:
                raise TimeoutError(f"rollout workers not running again within "
                                   f"{ENGINE_RETURN_TIMEOUT_S:.0f}s: {states}")
            time.sleep(1.0)
