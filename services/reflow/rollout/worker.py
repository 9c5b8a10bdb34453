"""The rollout worker: turns prompts into scored trajectories, one sample at a
time, and pushes every finished group to the replay buffer (paper §4.1
steps 1-2).

The worker owns an asyncio loop on its own thread. Its hot loop admits GRPO
groups while fewer than `max_inflight_samples` samples are in flight and the
job's dispatch budget allows (B_max per training step, one budget for all the
job's rollout workers, kept by the replay buffer: see `dispatch_limits`); each
sample streams from the engine, and when a group's last sample finishes the
group is scored, given group-normalised advantages and put. The worker knows
nothing of training steps; it learns of new policy versions only through
`update_weights`.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from reflow.core.config import JobSpec
from reflow.core.errors import FailedPrecondition
from reflow.core.types import Segment, Trajectory, group_advantages
from reflow.replay.client import ReplayClient
from reflow.rollout.engine import GenerationEngine, SamplingSpec, WeightSyncSpec
from reflow.rollout.tasks import Prompt, Task

logger = logging.getLogger(__name__)

# How often the loop asks the buffer for dispatch budget when it has none (backing
# off to the maximum while none comes, back to the minimum on a grant or a new
# policy version), and how often the engine's batch occupancy is sampled.
DISPATCH_POLL_S, DISPATCH_POLL_MAX_S = 0.01, 0.04
OCCUPANCY_TICK_S = 0.02


@dataclass
class _Sample:
    """A sample being generated: tokens, logprobs and version segments so far."""

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str = "length"

    def extend(self, ids: list[int], logprobs: list[float], version: int) -> None:
        self.response_ids += ids
        self.logprobs += logprobs
        if self.segments and self.segments[-1].policy_version == version:
            last = self.segments[-1]
            self.segments[-1] = Segment(version, last.num_tokens + len(ids))
        elif ids:
            self.segments.append(Segment(version, len(ids)))


@dataclass
class RolloutCounters:
    generated_tokens_total: int = 0
    finished_samples_total: int = 0
    idle_seconds_total: float = 0.0
    inflight_samples: int = 0
    policy_version: int = 0
    # Engine batch occupancy integrated over time (see _measure_occupancy).
    occupancy_seconds_total: float = 0.0
    # Seconds the engine took to build: start-up, reported apart from the steady state.
    engine_startup_s: float = 0.0


class RolloutWorker:
    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        engine_factory: Callable[[], GenerationEngine],
        task: Task,
        replay: ReplayClient,
        encode: Callable[[str], list[int]],
        decode: Callable[[list[int]], str],
        weight_sync: tuple[int, int, str] = (1, 2, "127.0.0.1"),
    ) -> None:
        """`weight_sync`: this worker's rank in the job's weight-sync group, the
        group's size, and the trainer's host; set by the scheduler at start."""
        self.job_id = job_id
        self.spec = spec
        self.engine_factory = engine_factory
        self.engine: GenerationEngine | None = None
        self.task = task
        self.replay = replay
        self.encode = encode
        self.decode = decode
        self.ready = threading.Event()
        self.counters = RolloutCounters()
        self.state = "idle"
        self.error = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="rollout-loop", daemon=True)
        self._stopping = False
        self._paused = False
        self._idle_since: float | None = time.monotonic()
        self._group_tasks: set[asyncio.Task] = set()
        # Set on the worker loop when a slot frees or a version loads: admission
        # looks again at once.
        self._wake = asyncio.Event()
        self.sync_rank, self.sync_world_size, self.trainer_host = weight_sync
        # Weight-sync state machine: none -> initialising -> ready; one update at a
        # time, versions strictly in order (see update_weights).
        self._sync_lock = threading.Lock()
        self._sync_state = "none"
        self._init: concurrent.futures.Future | None = None
        self._update: tuple[int, concurrent.futures.Future] | None = None

    # --- lifecycle (called from gRPC threads) --------------------------------

    def start(self) -> None:
        """Build the engine on the worker loop (vLLM binds its output handler to
        the loop it is built on), then start generating. Returns at once."""
        self.state = "starting"
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._build_and_run(), self._loop)

    def wait_ready(self, timeout_s: float) -> None:
        if not self.ready.wait(timeout_s):
            raise TimeoutError(f"rollout engine not ready after {timeout_s:.0f}s")
        if self.state == "failed":
            raise RuntimeError(f"rollout engine failed: {self.error}")

    async def _build_and_run(self) -> None:
        try:
            started = time.monotonic()
            self.engine = self.engine_factory()
            self.counters.engine_startup_s = time.monotonic() - started
        except Exception as err:  # noqa: BLE001 - reported through GetStats
            logger.exception("job %s: engine start failed", self.job_id)
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"
            self.ready.set()
            return
        self.state = "running"
        self.ready.set()
        # Both cancelled with the groups by stop().
        self._group_tasks.add(asyncio.current_task())
        self._group_tasks.add(asyncio.create_task(self._measure_occupancy()))
        await self._generate_forever()

    def stop(self, timeout_s: float = 30.0) -> None:
        if not self._thread.is_alive():
            return
        self._stopping = True
        fut = asyncio.run_coroutine_threadsafe(self._cancel_all(), self._loop)
        try:
            fut.result(timeout_s)
        except Exception:  # noqa: BLE001 - shutting down regardless
            logger.exception("rollout stop")
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout_s)
        if self.state in ("running", "starting"):
            self.state = "stopped"

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def call(self, coro, timeout_s: float | None = None):
        """Run a coroutine on the worker loop from another thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    # --- weights --------------------------------------------------------------

    def init_weight_sync(self, spec: WeightSyncSpec, timeout_s: float = 600.0) -> None:
        """Join the job's weight-sync group, once. Refused unless `spec` names this
        worker's place in the group. Waits at most `timeout_s` (the caller's
        deadline); the join itself goes on, on the worker loop, and a retry joins it."""
        with self._sync_lock:
            if self._sync_state == "ready":
                raise FailedPrecondition("weight sync is already set up for this job; "
                                         "it is set up once per job")
            if self._sync_state == "none":
                spec.check(self.sync_rank, self.sync_world_size, self.trainer_host)
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
            self.call(self.engine.init_weight_sync(spec), 600.0)
        except BaseException as err:  # noqa: BLE001 - handed to every waiter
            with self._sync_lock:
                self._sync_state = "none"
            done.set_exception(err)
            return
        with self._sync_lock:
            self._sync_state = "ready"
        done.set_result(None)

    def update_weights(self, policy_version: int, timeout_s: float = 600.0) -> tuple[float, float]:
        """Load policy version `policy_version`, which must be the next one. A call for
        the version already being loaded joins that update (a retried or early call
        waits for the trainer's broadcast instead of starting a second one); any other
        version is refused at once. Waits at most `timeout_s`; the update goes on."""
        with self._sync_lock:
            if self._sync_state != "ready":
                raise FailedPrecondition("weight sync is not set up for this job; "
                                         "InitWeightSync comes first")
            if self.state == "failed":
                raise FailedPrecondition(f"this rollout worker has failed: {self.error}")
            current = self.counters.policy_version
            if self._update is not None and not self._update[1].done():
                version, future = self._update
                if version != policy_version:
                    raise FailedPrecondition(f"policy_version: {policy_version} while the "
                                             f"update to {version} is in progress")
            elif policy_version != current + 1:
                if (policy_version == current and self._update is not None
                        and self._update[0] == current):
                    future = self._update[1]  # a retry of the update just done
                else:
                    raise FailedPrecondition(f"policy_version: {policy_version} is not the "
                                             f"next version ({current + 1})")
            else:
                future = asyncio.run_coroutine_threadsafe(
                    self._update_weights(policy_version), self._loop)
                self._update = (policy_version, future)
        try:
            return future.result(timeout_s)
        except concurrent.futures.TimeoutError:
            raise TimeoutError(f"weight update to v{policy_version} not done within "
                               f"{timeout_s:.1f}s; it goes on, and a retry waits for it") from None

    async def _update_weights(self, policy_version: int) -> tuple[float, float]:
        # Partial rollout (paper §4.1 step 4): in-flight requests stop at a token
        # boundary and are kept; tokens that arrive after the pause belong to the
        # new version.
        t0 = time.perf_counter()
        self._paused = True
        if not self.spec.rollout.partial_rollout:
            # Whole samples under one version (verl one_step_off): admit nothing more
            # and let what is in flight finish under the old weights first.
            while self.counters.inflight_samples > 0 and not self._stopping:
                await asyncio.sleep(OCCUPANCY_TICK_S / 4)
        await self.engine.pause()
        # Let the output handler hand over tokens generated before the pause.
        await asyncio.sleep(0)
        t1 = time.perf_counter()
        try:
            receive_s = await self.engine.receive_weights()
        except Exception as err:
            # Half-loaded weights must not generate: fail loudly, stay paused.
            self.state, self.error = "failed", f"weight update to v{policy_version}: {err}"
            raise
        self.counters.policy_version = policy_version
        await self.engine.resume()
        self._paused = False
        self._wake.set()
        logger.info(
            "job %s: policy version %d loaded (pause %.3fs, receive %.3fs)",
            self.job_id, policy_version, t1 - t0, receive_s,
        )
        return t1 - t0, receive_s

    # --- the loop ------------------------------------------------------------------

    def _mark_busy(self) -> None:
        if self._idle_since is not None:
            self.counters.idle_seconds_total += time.monotonic() - self._idle_since
            self._idle_since = None

    def idle_seconds(self) -> float:
        """Time with nothing in flight, including the current idle spell."""
        extra = time.monotonic() - self._idle_since if self._idle_since is not None else 0.0
        return self.counters.idle_seconds_total + extra

    def dispatch_limits(self) -> tuple[int, int]:
        """The job's dispatch bounds for this worker's policy version (paper §4.1 step 1),
        as the replay buffer applies them (see ReplayStore.acquire_dispatch):
        - outstanding (dispatched, not yet trained or evicted) at most B_max per step
          for 1 + look-ahead versions' worth of steps;
        - dispatched less evicted at most B_max per step for the steps up to this
          version plus the look-ahead (0 in sync, 1 in one_step_off, δ in the
          asynchronous modes). This one keeps sync on-policy: nothing starts
          between the trainer's release and the new weights arriving here.
        Evictions refund both, so a job can never starve itself of a batch."""
        per_version = self.spec.samples_per_step * self.spec.trainer.sync_interval
        ahead = self.spec.dispatch_ahead_versions
        return (per_version * (1 + ahead),
                per_version * (self.counters.policy_version + 1 + ahead))

    async def _generate_forever(self) -> None:
        prompts = self.task.prompts()
        group_size = self.spec.rollout.group_size
        concurrency = self.spec.rollout.max_inflight_samples
        granted = 0  # granted by the buffer, not yet started (a pause came between)
        poll_s = DISPATCH_POLL_S
        try:
            while not self._stopping:
                # Admit whole GRPO groups while (a) the worker's concurrency cap leaves
                # room and (b) the job's dispatch budget does: the budget is what
                # bounds how far rollout runs ahead of training.
                room = (concurrency - self.counters.inflight_samples) // group_size * group_size
                refused = False
                if room and not self._paused and granted < room:
                    outstanding_limit, version_limit = self.dispatch_limits()
                    got = await asyncio.to_thread(
                        self.replay.acquire_dispatch, self.job_id, room - granted, group_size,
                        outstanding_limit, version_limit)
                    granted, refused = granted + got, got == 0
                if granted >= group_size and room and not self._paused:
                    for _ in range(min(granted, room) // group_size):
                        self._admit(next(prompts))
                        granted -= group_size
                    poll_s = DISPATCH_POLL_S
                    continue
                # Back off only while the budget refuses; a freed slot or a new
                # version wakes the loop at once.
                if not refused:
                    poll_s = DISPATCH_POLL_S
                try:
                    await asyncio.wait_for(self._wake.wait(), poll_s)
                    poll_s = DISPATCH_POLL_S
                except TimeoutError:
                    if refused:
                        poll_s = min(2 * poll_s, DISPATCH_POLL_MAX_S)
                self._wake.clear()
        except Exception as err:  # noqa: BLE001 - reported through GetStats
            logger.exception("rollout loop failed")
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"

    def _admit(self, prompt: Prompt) -> None:
        group_size = self.spec.rollout.group_size
        self.counters.inflight_samples += group_size
        self._mark_busy()
        task = asyncio.create_task(self._run_group(prompt))
        self._group_tasks.add(task)
        task.add_done_callback(self._group_tasks.discard)

    async def _measure_occupancy(self) -> None:
        """Integrate the engine's batch occupancy: requests it is running (its own
        scheduler's count where it reports one) over the concurrency cap. Samples
        that wait in our queue or in a paused engine do not count as busy."""
        cap = self.spec.rollout.max_inflight_samples
        last = time.monotonic()
        while True:
            await asyncio.sleep(OCCUPANCY_TICK_S)
            now = time.monotonic()
            load = getattr(self.engine, "load", None)
            running = self.counters.inflight_samples
            if load is not None:
                running = min(running, load.running_requests)
            if self._paused:
                running = 0
            self.counters.occupancy_seconds_total += (now - last) * min(1.0, running / cap)
            last = now

    async def _run_group(self, prompt: Prompt) -> None:
        group_id = uuid.uuid4().hex[:16]
        group_size = self.spec.rollout.group_size
        try:
            prompt_ids = self.encode(prompt.text)
        except Exception as err:  # noqa: BLE001 - no sample started: give every slot back
            self._free_slots(group_size)
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"
            return
        try:
            samples = await asyncio.gather(
                *(self._run_sample(f"{group_id}-{i}", prompt_ids) for i in range(group_size))
            )
            trajectories = self._score(group_id, prompt, prompt_ids, samples)
            await asyncio.to_thread(self.replay.put, self.job_id, trajectories)
        except asyncio.CancelledError:
            raise
        except Exception as err:  # noqa: BLE001
            logger.exception("job %s: group %s failed", self.job_id, group_id)
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"

    async def _run_sample(self, request_id: str, prompt_ids: list[int]) -> _Sample:
        """One sample; its concurrency slot is freed the moment it finishes, not when
        the slowest sample of its group does (sample-level streaming, paper §4.1)."""
        sample = _Sample()
        sampling = SamplingSpec(
            max_tokens=self.spec.rollout.max_tokens, temperature=self.spec.rollout.temperature
        )
        try:
            async for delta in self.engine.generate(request_id, prompt_ids, sampling):
                sample.extend(delta.token_ids, delta.logprobs, self.counters.policy_version)
                self.counters.generated_tokens_total += len(delta.token_ids)
                if delta.finished:
                    sample.finish_reason = delta.finish_reason or "stop"
            self.counters.finished_samples_total += 1
            return sample
        finally:
            self._free_slots(1)

    def _free_slots(self, n: int) -> None:
        self.counters.inflight_samples -= n
        self._wake.set()
        if self.counters.inflight_samples == 0:
            self._idle_since = time.monotonic()

    def _score(
        self, group_id: str, prompt: Prompt, prompt_ids: list[int], samples: list[_Sample]
    ) -> list[Trajectory]:
        rewards = [self.task.reward(prompt, self.decode(s.response_ids)) for s in samples]
        advantages = group_advantages(rewards)
        now = time.time()
        return [
            Trajectory(
                sample_id=f"{group_id}-{i}",
                group_id=group_id,
                prompt_ids=prompt_ids,
                response_ids=s.response_ids,
                logprobs=s.logprobs,
                loss_mask=[1] * len(s.response_ids),
                segments=s.segments,
                reward=r,
                advantage=a,
                finish_reason=s.finish_reason,
                created_at=now,
            )
            for i, (s, r, a) in enumerate(zip(samples, rewards, advantages))
        ]

    async def _cancel_all(self) -> None:
        for task in list(self._group_tasks):
            task.cancel()
        self._group_tasks.discard(asyncio.current_task())
        await asyncio.gather(*self._group_tasks, return_exceptions=True)
        # The engine's output handler lives on this loop: shut it down while the
        # loop still runs.
        if self.engine is not None:
            self.engine.shutdown()
