"""The rollout worker: turns prompts into scored trajectories, one sample at a
time, and pushes every finished group to the replay buffer (paper §4.1
steps 1-2).

The worker owns an asyncio loop on its own thread. Its hot loop admits GRPO
groups while fewer than `max_inflight_samples` samples are in flight and the
per-step dispatch budget (B_max per training step, see `dispatch_budget`)
allows; each sample streams from the engine, and when a group's last sample
finishes the group is scored, given group-normalised advantages and put. The worker knows nothing of training steps; it learns of
new policy versions only through `update_weights`.
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
    dispatched_samples: int = 0
    policy_version: int = 0


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
            self.engine = self.engine_factory()
        except Exception as err:  # noqa: BLE001 - reported through GetStats
            logger.exception("job %s: engine start failed", self.job_id)
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"
            self.ready.set()
            return
        self.state = "running"
        self.ready.set()
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

    def dispatch_budget(self) -> int:
        """Samples that may have been dispatched by now (paper §4.1 step 1): B_max per
        training step, for the steps up to the current policy version plus the
        mode's look-ahead (0 in sync, 1 in one_step_off, δ in the async modes)."""
        steps = (self.counters.policy_version + 1 + self.spec.dispatch_ahead_versions)
        return self.spec.samples_per_step * self.spec.trainer.sync_interval * steps

    async def _generate_forever(self) -> None:
        prompts = self.task.prompts()
        group_size = self.spec.rollout.group_size
        concurrency = self.spec.rollout.max_inflight_samples
        try:
            while not self._stopping:
                # Admit one GRPO group when (a) the worker's concurrency cap leaves
                # room and (b) the per-step dispatch budget does: the budget is what
                # bounds how far rollout runs ahead of training.
                room = self.counters.inflight_samples + group_size <= concurrency
                budget = self.counters.dispatched_samples + group_size <= self.dispatch_budget()
                if room and budget and not self._paused:
                    prompt = next(prompts)
                    self.counters.inflight_samples += group_size
                    self.counters.dispatched_samples += group_size
                    self._mark_busy()
                    task = asyncio.create_task(self._run_group(prompt))
                    self._group_tasks.add(task)
                    task.add_done_callback(self._group_tasks.discard)
                    continue
                await asyncio.sleep(0.005)
        except Exception as err:  # noqa: BLE001 - reported through GetStats
            logger.exception("rollout loop failed")
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"

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
        await asyncio.gather(*self._group_tasks, return_exceptions=True)
        # The engine's output handler lives on this loop: shut it down while the
        # loop still runs.
        if self.engine is not None:
            self.engine.shutdown()
