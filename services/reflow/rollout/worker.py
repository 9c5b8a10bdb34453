"""The rollout worker: turns prompts into scored trajectories, one sample at a
time, and pushes every finished group to the replay buffer (paper §4.1
step 2).

The worker only generates. What to generate, and how much at once, is the
job's dispatcher's call (reflow.scheduler.generation.dispatch, paper §6.1): it submits
GRPO groups by id (`submit_group`, idempotent) and follows each sample's end
through the worker's event log (`wait_events`), which is how it frees that
sample's concurrency slot the moment it ends, not when the slowest sample of
its group does. When a group's last sample finishes the group is scored,
given the job's advantages (`algorithm.advantage`) and put, unless dynamic
sampling drops it (`algorithm.dynamic_sampling`: its rewards are all equal;
its end event says GROUP_FILTERED and the dispatcher draws a new prompt on
its grant). The worker knows nothing of
training steps; it learns of new policy versions only through
`update_weights`, and a group submitted during an update waits for it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable

from reflow.core.config import JobSpec
from reflow.core.errors import FailedPrecondition
from reflow.replay.client import ReplayClient
from reflow.rollout.engine import GenerationEngine, SamplingSpec
from reflow.rollout.records import (GROUP_FILTERED, GROUP_RETURNED, PartialSample,
                                    RolloutCounters, SampleEvent)
from reflow.rollout.multiturn import EpisodeRunner
from reflow.rollout.weights import WeightSyncMixin
from reflow.rollout.scoring import (ErrorWindow, GroupScoring, Scorer, group_trajectories,
                                    score_inline, score_texts)
from reflow.tasks.base import Prompt, Task

logger = logging.getLogger(__name__)

# How often the engine's batch occupancy and KV-cache use are sampled.
OCCUPANCY_TICK_S = 0.02
# Sample and group events kept for the dispatcher to read (a reconnecting reader
# resumes from its last sequence number within this window), and group ids
# remembered so that a retried submission is not generated twice.
EVENT_LOG_SIZE = 65536
GROUP_MEMORY = 16384


class RolloutWorker(WeightSyncMixin):
    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        engine_factory: Callable[[], GenerationEngine],
        task: Task,
        replay: ReplayClient,
        encode: Callable[[Prompt], list[int]],
        decode: Callable[[list[int]], str],
        weight_sync: tuple[int, int, str] = (1, 2, "127.0.0.1"),
        score: Scorer | None = None,
        episodes: EpisodeRunner | None = None,
    ) -> None:
        """`encode` renders a prompt to token ids (the model's chat template for a
        chat task); `score` rewards a decoded response (the service's reward pool;
        None: in this thread, without a timeout); `episodes` plays a multi-turn
        task's episodes instead (each sample one episode). `weight_sync`: this worker's rank
        in the job's weight-sync group, the group's size, and the trainer's host;
        set by the scheduler at start."""
        self.job_id = job_id
        self.spec = spec
        self.engine_factory = engine_factory
        self.engine: GenerationEngine | None = None
        self.task = task
        self.replay = replay
        self.encode = encode
        self.decode = decode
        self.score = score or score_inline(task)
        if isinstance(episodes, EpisodeRunner) and getattr(task, "agent", False) is True:
            # An agent task's episodes are its agent program's (rollout/agent_episode.py).
            from reflow.rollout.agent_episode import AgentRunner

            episodes = AgentRunner(task, episodes.renderer, spec)
        self.episodes = episodes
        self.scoring = GroupScoring(spec.algorithm)
        self.reward_errors = ErrorWindow(spec.task.max_reward_error_rate,
                                         spec.task.reward_error_window)
        self.ready = threading.Event()
        self.counters = RolloutCounters()
        self.state = "idle"
        self.error = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run_loop, name="rollout-loop", daemon=True)
        self._stopping = False
        self._paused = False
        # Engine preemptions seen until this time are the weight update's (see
        # _measure_occupancy): the engine reports them on its first steps after resuming.
        self._sync_preemption_until = 0.0
        self._idle_since: float | None = time.monotonic()
        self._group_tasks: set[asyncio.Task] = set()
        # Set while no weight update is in progress; a submitted group waits on it.
        self._resumed: asyncio.Event | None = None
        # Samples past that wait: generating under the loaded version (loop thread only).
        self._generating = 0
        # The event log the dispatcher reads, and the group ids seen (idempotence).
        self._events: deque[SampleEvent] = deque(maxlen=EVENT_LOG_SIZE)
        self._event_seq = 0
        self._events_cond = threading.Condition()
        self._groups: OrderedDict[str, None] = OrderedDict()
        self.counters.concurrency_cap = spec.concurrency_cap
        # An AsyncHybrid worker in the trainer role (paper §5): the engine stays warm
        # and keeps loading each published version, but admits no group.
        self.standby = False
        self._handing_back = False
        self._putting: set[str] = set()
        self.returned_groups_total = 0
        # What the engine released the last time it went to standby (bytes, RSS).
        self.last_release: dict[str, int] = {}
        self.sync_rank, self.sync_world_size, self.trainer_host = weight_sync
        # Weight-sync state machine: none -> initialising -> ready; one update at a
        # time, versions strictly in order (see update_weights).
        self._sync_lock = threading.Lock()
        self._sync_state = "none"
        self._init: concurrent.futures.Future | None = None
        self._update: tuple[int, concurrent.futures.Future] | None = None
        # The group joined (master address, port), and whether the next update may
        # skip versions: the first after joining a restarted trainer's group.
        self._sync_address: tuple[str, int] | None = None
        self._rejoined = False

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
            await self._label_weights(self.counters.policy_version)
        except Exception as err:  # noqa: BLE001 - reported through GetStats
            logger.exception("job %s: engine start failed", self.job_id)
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"
            self.ready.set()
            return
        self.counters.kv_cache_tokens = int(getattr(self.engine, "kv_cache_tokens", 0) or 0)
        self._resumed = asyncio.Event()
        self._resumed.set()
        self.state = "running"
        self.ready.set()
        # Cancelled with the groups by stop().
        self._group_tasks.add(asyncio.create_task(self._measure_occupancy()))

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
        if hasattr(self.episodes, "close"):
            self.episodes.close()  # an agent runner's reward processes
        if self.state in ("running", "starting"):
            self.state = "stopped"

    def _run_loop(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.run_forever()

    def call(self, coro, timeout_s: float | None = None):
        """Run a coroutine on the worker loop from another thread and wait for it."""
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout_s)

    def score_tokens(self, token_ids: list[int], timeout_s: float = 60.0
                     ) -> tuple[int, list[float]]:
        """(loaded policy version, log p of each token after the first) under the
        engine's weights: the weight-sync check's probe (trainer/sync_check.py).
        The trainer calls it between its publishes, so the version cannot move
        under it."""
        if self.state != "running":
            raise FailedPrecondition(f"rollout worker is {self.state}")
        score = getattr(self.engine, "score", None)
        if score is None:
            raise FailedPrecondition(f"{type(self.engine).__name__} cannot score tokens; set "
                                     "rollout.sync_check to false for it")
        version = self.counters.policy_version
        return version, self.call(score(list(token_ids)), timeout_s)

    def evaluate(self, plan, timeout_s: float = 600.0):
        """Score the task's held-out split under the loaded weights as `plan`
        (an EvalPlan: prompts, k, sampling) says (rollout/evaluation.py); waits at
        most `timeout_s`."""
        from reflow.rollout.evaluation import run_evaluation

        if self.state != "running":
            raise FailedPrecondition(f"rollout worker is {self.state}")
        return self.call(run_evaluation(self, plan), timeout_s)

    # --- groups and events (called from gRPC threads) -------------------------------

    def _mark_busy(self) -> None:
        if self._idle_since is not None:
            self.counters.idle_seconds_total += time.monotonic() - self._idle_since
            self._idle_since = None

    def idle_seconds(self) -> float:
        """Time with nothing in flight, including the current idle spell."""
        extra = time.monotonic() - self._idle_since if self._idle_since is not None else 0.0
        return self.counters.idle_seconds_total + extra

    def submit_group(self, group_id: str, prompt: Prompt, concurrency_cap: int = 0,
                     bounds: tuple[int, int] | None = None) -> bool:
        """Start generating one GRPO group for `prompt`. Idempotent by `group_id`: a
        group already submitted is not generated again (False). `concurrency_cap` is
        the cap the dispatcher holds this worker to, for the occupancy measure;
        `bounds` (min_tokens, max_tokens) its responses' lengths (the spec's
        curriculum stage; None: rollout.max_tokens)."""
        min_tokens, max_tokens = bounds or (0, self.spec.rollout.max_tokens)
        if not 0 <= min_tokens <= max_tokens <= self.spec.rollout.longest_response:
            raise ValueError(f"min_tokens/max_tokens: {min_tokens}/{max_tokens}; need 0 <= "
                             f"min <= max <= {self.spec.rollout.longest_response} (the spec's "
                             "longest response)")
        if self.state != "running":
            raise FailedPrecondition(f"rollout worker is {self.state}"
                                     + (f": {self.error}" if self.error else ""))
        if self.standby:
            raise FailedPrecondition("rollout worker stands by: its worker has the trainer role")
        if not group_id or len(group_id) > 64:
            raise ValueError("group_id: 1-64 characters required")
        with self._events_cond:
            if group_id in self._groups:
                return False
            self._groups[group_id] = None
            while len(self._groups) > GROUP_MEMORY:
                self._groups.popitem(last=False)
            if concurrency_cap > 0:
                self.counters.concurrency_cap = concurrency_cap
            self.counters.inflight_samples += self.spec.rollout.group_size
        sampling = SamplingSpec(max_tokens=max_tokens, min_tokens=min_tokens,
                                temperature=self.spec.rollout.temperature,
                                top_p=self.spec.rollout.top_p, top_k=self.spec.rollout.top_k)
        self._loop.call_soon_threadsafe(self._start_group, group_id, prompt, sampling)
        return True

    def set_standby(self, standby: bool, drain_timeout_s: float = 0.0,
                    hand_back: bool = False) -> int:
        """Stop (or resume) admitting groups. Stopping either hands the groups in
        flight back (`hand_back`: generation is aborted and each group's end event
        says GROUP_RETURNED, so the dispatcher routes its prompt again with the same
        budget; the partial tokens are discarded), or waits up to `drain_timeout_s`
        for them to finish into the buffer as usual. Returns the samples still
        generating when it returns."""
        if not standby:
            self._restore_memory()  # before admitting again
        self.standby = standby
        if standby and hand_back and self.state == "running":
            self.returned_groups_total += self.call(self._hand_back(), 60.0)
        deadline = time.monotonic() + drain_timeout_s
        with self._events_cond:
            while standby and self.counters.inflight_samples > 0 and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._events_cond.wait(min(left, 0.5))
            left_generating = self.counters.inflight_samples
        if standby and not left_generating:
            self._release_memory()
        return left_generating

    def _release_memory(self) -> None:
        """An idle standby engine gives its KV cache memory back (paper §5), where
        the engine can; the worker's trainer replica may need it."""
        release = getattr(self.engine, "release_memory", None)
        if release is None or self.state != "running":
            return
        try:
            self.last_release = self.call(release(), 60.0)
            logger.info("standby: released %.0f MB of KV cache (engine RSS %.0f -> %.0f MB)",
                        self.last_release["released"] / 2**20,
                        self.last_release["rss_before"] / 2**20,
                        self.last_release["rss_after"] / 2**20)
        except Exception as err:  # noqa: BLE001 - the memory stays; nothing else changes
            logger.warning("standby: the engine kept its memory (%s)", err)

    def _restore_memory(self) -> None:
        """Back from standby: what the engine released returns before it admits
        (a sleeping GPU engine wakes)."""
        restore = getattr(self.engine, "restore_memory", None)
        if restore is not None and self.state == "running":
            self.call(restore(), 120.0)

    def wait_events(self, since_seq: int, timeout_s: float) -> list[SampleEvent]:
        """Events after `since_seq`, waiting up to `timeout_s` for the first. A reader
        that fell further behind than the log keeps gets what is left."""
        deadline = time.monotonic() + timeout_s
        with self._events_cond:
            while self._event_seq <= since_seq and not self._stopping:
                left = deadline - time.monotonic()
                if left <= 0:
                    return []
                self._events_cond.wait(left)
            # Sequence numbers are consecutive, so the events after since_seq are the
            # log's newest ones: read from its end, not through the whole log (up to
            # EVENT_LOG_SIZE) on every call.
            newer = max(0, min(self._event_seq - since_seq, len(self._events)))
            return list(itertools.islice(reversed(self._events), newer))[::-1]

    def _emit(self, group_id: str, sample_index: int, response_tokens: int = 0,
              prompt_tokens: int = 0, error: str = "") -> None:
        with self._events_cond:
            self._event_seq += 1
            self._events.append(SampleEvent(self._event_seq, group_id, sample_index,
                                            response_tokens, prompt_tokens,
                                            self.counters.policy_version, error))
            self._events_cond.notify_all()

    def _start_group(self, group_id: str, prompt: Prompt, sampling: SamplingSpec) -> None:
        self._mark_busy()
        task = asyncio.create_task(self._run_group(group_id, prompt, sampling), name=group_id)
        self._group_tasks.add(task)
        task.add_done_callback(self._group_tasks.discard)

    def _engine_generated(self) -> int | None:
        """Tokens the engine has sampled, where it counts them itself: then they
        count as they are sampled, even where outputs come only at a sample's end."""
        return getattr(getattr(self.engine, "load", None), "generated_tokens_total", None)

    async def _measure_occupancy(self) -> None:
        """Integrate the engine's batch occupancy: requests it is running (its own
        scheduler's count where it reports one) over the concurrency cap. Samples
        that wait in our queue or in a paused engine do not count as busy."""
        last = time.monotonic()
        seen_preempted = seen_generated = 0
        while True:
            await asyncio.sleep(OCCUPANCY_TICK_S)
            now = time.monotonic()
            cap = max(1, self.counters.concurrency_cap)
            load = getattr(self.engine, "load", None)
            running = self.counters.inflight_samples
            generated = self._engine_generated()
            if generated is not None:
                self.counters.generated_tokens_total += generated - seen_generated
                seen_generated = generated
            if load is not None:
                running = min(running, load.running_requests)
                self.counters.engine_decode_steps_total = load.decode_steps_total
                self.counters.kv_usage_seconds_total += (now - last) * load.kv_cache_usage_ratio
                new = load.preempted_requests_total - seen_preempted
                seen_preempted = load.preempted_requests_total
                if self._paused or now < self._sync_preemption_until:
                    self.counters.sync_preempted_requests_total += new
                else:
                    self.counters.preempted_requests_total += new
            if self._paused:
                running = 0
            self.counters.occupancy_seconds_total += (now - last) * min(1.0, running / cap)
            if running > 0:
                self.counters.engine_busy_seconds_total += now - last
            last = now

    async def _run_group(self, group_id: str, prompt: Prompt, sampling: SamplingSpec) -> None:
        group_size = self.spec.rollout.group_size
        try:
            # A multi-turn episode renders its own first prompt (the environment's).
            prompt_ids = [] if self.episodes else self.encode(prompt)
        except Exception as err:  # noqa: BLE001 - no sample started: give every slot back
            self._free_slots(group_size)
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"
            self._emit(group_id, -1, error=self.error)
            return
        # Which samples still hold a concurrency slot: a sample task cancelled before
        # its first step never runs its own `finally`.
        holding = [True] * group_size
        generating = False
        try:
            # Partial rollout: a group submitted during a weight update starts after it.
            await self._resumed.wait()
            self._generating += group_size
            generating = True
            if self.episodes is not None:
                episodes = await asyncio.gather(
                    *(self._run_episode(group_id, i, prompt, holding, sampling)
                      for i in range(group_size)))
                trajectories, results = self.episodes.trajectories(group_id, episodes,
                                                                   self.scoring)
                self._count_rewards(results)
            else:
                samples = await asyncio.gather(
                    *(self._run_sample(group_id, i, prompt_ids, holding, sampling)
                      for i in range(group_size)))
                trajectories = await self._score(group_id, prompt, prompt_ids, samples,
                                                 sampling.max_tokens)
            if self.scoring.drops(trajectories):
                # DAPO's dynamic sampling: no member has an advantage, so the group
                # never reaches the buffer; the dispatcher spends its grant on a new
                # prompt, which keeps the batches full.
                self.counters.filtered_groups_total += 1
                self._emit(group_id, -1, error=GROUP_FILTERED)
                return
            # Finished: from here the group goes to the buffer, never back (_hand_back).
            self._putting.add(group_id)
            try:
                await asyncio.to_thread(self.replay.put, self.job_id, trajectories)
            except Exception as err:
                if not (_refused(err) and await self._leaving_rollout()):
                    raise
                # The worker left rollout while this put was under way: its pass for
                # the job is the trainer's now, which may not put. Nothing was stored;
                # the dispatcher routes the group again, as one handed back.
                logger.warning("job %s: group %s not put (the worker left rollout): %s",
                               self.job_id, group_id, err)
                self._emit(group_id, -1, error=GROUP_RETURNED)
                return
            finally:
                self._putting.discard(group_id)
            self._emit(group_id, -1)
        except asyncio.CancelledError:
            left = sum(holding)
            if generating:
                self._generating -= left
            self._free_slots(left)
            if self._handing_back:
                # Its worker leaves rollout: the dispatcher routes the group again.
                self._emit(group_id, -1, error=GROUP_RETURNED)
            raise
        except Exception as err:  # noqa: BLE001
            logger.exception("job %s: group %s failed", self.job_id, group_id)
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"
            self._emit(group_id, -1, error=self.error)

    async def _run_sample(self, group_id: str, index: int, prompt_ids: list[int],
                          holding: list[bool], sampling: SamplingSpec) -> PartialSample:
        """One sample; its end is an event at once, so the dispatcher frees its
        concurrency slot then, not when the slowest sample of its group ends
        (sample-level streaming, paper §4.1)."""
        request_id = f"{group_id}-{index}"
        sample = PartialSample(min_tokens=sampling.min_tokens)
        try:
            async for delta in self.engine.generate(request_id, prompt_ids, sampling):
                sample.extend(delta.token_ids, delta.logprobs,
                              delta.segments or [(self.counters.policy_version,
                                                  len(delta.token_ids))])
                if self._engine_generated() is None:
                    self.counters.generated_tokens_total += len(delta.token_ids)
                if delta.finished:
                    sample.finish_reason = delta.finish_reason or "stop"
            self.counters.finished_samples_total += 1
            self._emit(group_id, index, len(sample.response_ids), len(prompt_ids))
            return sample
        finally:
            self._generating -= 1
            holding[index] = False
            self._free_slots(1)

    async def _run_episode(self, group_id: str, index: int, prompt: Prompt,
                           holding: list[bool], sampling: SamplingSpec):
        """One sample of a multi-turn task: a whole episode, which holds its
        concurrency slot from its first turn to its last."""
        async def generate(request_id, ids, turn_sampling):
            async for delta in self.engine.generate(request_id, ids, turn_sampling):
                if self._engine_generated() is None:
                    self.counters.generated_tokens_total += len(delta.token_ids)
                yield delta

        try:
            episode = await self.episodes.play(generate, f"{group_id}-{index}", prompt, sampling,
                                               lambda: self.counters.policy_version)
            self.counters.finished_samples_total += 1
            self._emit(group_id, index, len(episode.response_ids), len(episode.prompt_ids))
            return episode
        finally:
            self._generating -= 1
            holding[index] = False
            self._free_slots(1)

    def _free_slots(self, n: int) -> None:
        with self._events_cond:
            self.counters.inflight_samples -= n
            if self.counters.inflight_samples == 0:
                self._idle_since = time.monotonic()
                self._events_cond.notify_all()  # a drain (set_standby) waits for this

    async def _score(self, group_id: str, prompt: Prompt, prompt_ids: list[int],
                     samples: list[PartialSample], max_tokens: int):
        """Rewards off the event loop (reflow.tasks.rewards); a sample without one is
        excluded from the loss (rollout/scoring.py), and past the job's error rate
        the worker fails with the counts. `max_tokens`: the limit the samples were
        generated under (the curriculum stage's), for the over-length penalty."""
        results = await score_texts(self.score, prompt,
                                    [self.decode(s.response_ids) for s in samples])
        self._count_rewards(results)
        return group_trajectories(group_id, prompt_ids, samples, results,
                                  scoring=self.scoring, max_tokens=max_tokens)

    def _count_rewards(self, results) -> None:
        self.counters.scored_samples_total += len(results)
        for r in results:
            if r.error:
                logger.warning("job %s: sample without reward (%s: %s)", self.job_id, r.error,
                               r.message)
        verdict = self.reward_errors.add(results)
        self.counters.reward_errors_total = dict(self.reward_errors.totals)
        if verdict:
            raise RuntimeError(verdict)

    async def _leaving_rollout(self, wait_s: float = 2.0) -> bool:
        """Whether this worker is moving to the trainer role: its standby, which the
        role change sets just after the scheduler's call swapped its job pass."""
        deadline = time.monotonic() + wait_s
        while not self.standby and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        return self.standby

    async def _hand_back(self) -> int:
        tasks = [t for t in self._group_tasks
                 if not t.done() and t.get_name() not in self._putting]
        self._handing_back = True
        try:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._handing_back = False
        return len(tasks)

    async def _cancel_all(self) -> None:
        with self._events_cond:
            self._events_cond.notify_all()  # readers return at once (_stopping is set)
        for task in list(self._group_tasks):
            task.cancel()
        self._group_tasks.discard(asyncio.current_task())
        await asyncio.gather(*self._group_tasks, return_exceptions=True)
        # The engine's output handler lives on this loop: shut it down while the
        # loop still runs.
        if self.engine is not None:
            self.engine.shutdown()


def _refused(err: Exception) -> bool:
    """A call the server refused for the caller's role (gRPC PERMISSION_DENIED),
    told without importing gRPC here."""
    code = getattr(err, "code", None)
    return callable(code) and getattr(code(), "name", "") == "PERMISSION_DENIED"
