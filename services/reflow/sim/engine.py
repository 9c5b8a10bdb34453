"""A simulated rollout engine: the dispatcher's WorkerClient, on a cost model.

Continuous batching as vLLM schedules it: waiting sequences join the running
batch at a step boundary while the KV cache and max_num_seqs allow; every
decode step adds one token to every running sequence and costs
DecodeCost.steps_time_s; when the cache runs out the newest sequence is
preempted and recomputed later (its prompt and tokens prefilled again). Time
advances lazily, in whole steps, when the simulation asks (`advance_to`); a
sequence submitted between two boundaries joins at the earlier one (less than
one step early). A finished group goes to the replay buffer through the
product's ReplayClient, as a worker's put, with the job's advantages (the
worker's GroupScoring), and its end is reported as the worker's events are
(SampleEvent); with dynamic sampling a group whose rewards are all equal is
not put, and its end event says GROUP_FILTERED, as a worker's does.

Multi-turn episodes (ToolCost.turns > 1): at the end of each turn but the last a
sequence leaves the batch, frees its KV, and waits out a tool call; it then
joins the queue again with the tool's output added to its prompt, prefilling
only that (the rest from the prefix cache)."""

from __future__ import annotations

import heapq
import math
import random
from dataclasses import dataclass, field

from reflow.core.clock import VirtualClock
from reflow.core.types import Segment, Trajectory
from reflow.replay.client import ReplayClient
from reflow.rollout.client import RolloutStats
from reflow.rollout.records import GROUP_FILTERED, GROUP_RETURNED, SampleEvent
from reflow.rollout.scoring import GroupScoring
from reflow.sim.costs import CostModel
from reflow.tasks import Prompt


@dataclass
class _Seq:
    group_id: str
    index: int
    prompt_tokens: int
    target: int  # response tokens it will generate
    done_segments: list[list[int]] = field(default_factory=list)  # [version, tokens]
    generated: int = 0  # before its current run
    run_start: int = 0  # the engine's token counter when this run began
    context: int = 0  # KV tokens held at run start (prompt + generated)
    admitted: bool = False
    turn_ends: list[int] = field(default_factory=list)  # generated counts ending a turn
    cached: int = 0  # context tokens the prefix cache holds (not prefilled again)

    @property
    def stop(self) -> int:
        """Generated tokens at which this run stops: its turn's end, or its end."""
        return self.turn_ends[0] if self.turn_ends else self.target


@dataclass
class _Group:
    prompt: Prompt
    members: list[_Seq]
    reward_p: float
    left: int


class SimEngine:
    """One engine of `gpus` GPUs (tensor parallel), named as a worker."""

    def __init__(self, name: str, job_id: str, costs: CostModel, replay: ReplayClient,
                 rng: random.Random, group_size: int, step_of, sample_tokens: dict,
                 clock: VirtualClock, scoring: GroupScoring | None = None) -> None:
        """`step_of()`: the trainer's step (the length curriculum's); `sample_tokens`:
        sample id -> (prompt, response) tokens, filled as samples finish; `scoring`
        the job's advantage estimator and dynamic sampling (None: GRPO's, off)."""
        self.name, self.job_id, self.costs, self.replay = name, job_id, costs, replay
        self.group_size, self.sample_tokens, self.clock = group_size, sample_tokens, clock
        self.decode = costs.decode
        self.rng, self._step_of = rng, step_of
        self.scoring = scoring or GroupScoring()
        self.t = 0.0
        self.counter = 0  # decode steps taken; a running sequence's length grows with it
        self.running: dict[tuple[str, int], _Seq] = {}
        self._ends: list[tuple[int, str, int]] = []  # (counter at its end, group, index)
        self.waiting: list[_Seq] = []
        self._tools: list[tuple[float, int, _Seq]] = []  # (back at, tie, seq) in a tool call
        self.context = 0  # KV tokens of the running batch
        self.groups: dict[str, _Group] = {}
        self.version = 0
        self._versions: list[tuple[int, int]] = [(0, 0)]  # (counter, version) from then
        self.paused_until = 0.0  # a weight load
        self.draining = False  # no admission until the running batch finishes
        self._next: float | None = None  # next_time, until the state changes
        self.events: list[SampleEvent] = []
        self._seq = 0
        self._seq_tool = 0
        # RolloutStats' counters.
        self.generated_tokens = self.finished_samples = self.preemptions = self.decode_steps = 0
        self.idle_s = self.kv_usage_s = self.occupancy_s = self.busy_s = 0.0
        self.cap = 0
        self.filtered_groups = 0

    # --- WorkerClient -----------------------------------------------------------------

    def submit_group(self, job_id: str, group_id: str, prompt: Prompt,
                     concurrency_cap: int = 0, bounds: tuple[int, int] | None = None) -> bool:
        self.advance_to(self.clock.now)  # an idle engine starts the group now
        self._next = None
        lengths = self.costs.lengths
        median = lengths.group_median(self.rng)
        members = [_Seq(group_id, i, lengths.prompt_tokens,
                        lengths.sample(self.rng, median, self._step_of()))
                   for i in range(self.group_size)]
        if bounds is not None:
            for m in members:
                m.target = max(bounds[0], min(bounds[1], m.target))
        turns = self.costs.tools.turns
        for m in members:
            m.turn_ends = sorted({m.target * k // turns for k in range(1, turns)} - {0})
        self.cap = concurrency_cap
        # A harder prompt (longer answers) is solved less often: rewards vary in a group.
        self.groups[group_id] = _Group(prompt, members, min(0.9, 500.0 / median), len(members))
        self.waiting.extend(members)
        return True

    def wait_events(self, job_id: str, since_seq: int, wait_s: float) -> list[SampleEvent]:
        return [e for e in self.events if e.seq > since_seq]

    def stats(self, job_id: str) -> RolloutStats:
        return RolloutStats(
            generated_tokens_total=self.generated_tokens,
            finished_samples_total=self.finished_samples, idle_seconds_total=self.idle_s,
            inflight_samples=len(self.running) + len(self.waiting), policy_version=self.version,
            state="running", error="", occupancy_seconds_total=self.occupancy_s,
            kv_usage_seconds_total=self.kv_usage_s, preempted_requests_total=self.preemptions,
            kv_cache_tokens=self.decode.kv_capacity_tokens, concurrency_cap=self.cap,
            engine_busy_seconds_total=self.busy_s, engine_decode_steps_total=self.decode_steps,
            filtered_groups_total=self.filtered_groups)

    # --- the simulation's side ------------------------------------------------------

    def take_events(self) -> list[SampleEvent]:
        events, self.events = self.events, []
        return events

    @property
    def busy(self) -> bool:
        return bool(self.running or self.waiting or self._tools)

    def next_time(self) -> float:
        """When the next sequence ends (inf: nothing runs)."""
        if self._next is None:
            self._next = self._next_time()
        return self._next

    def _next_time(self) -> float:
        self._admit()
        start = max(self.t, self.paused_until)
        # A tool call that returns during a weight-sync pause changes nothing before the
        # pause ends (advance_to takes no step in it): an earlier time would be an event
        # that never happens, and the run loop would wait on it for ever.
        tool = max(self._tools[0][0], start) if self._tools else math.inf
        if not self.running:
            return tool
        steps = self._steps_to_next_change()
        return min(tool, start + self.decode.steps_time_s(len(self.running), self.context, steps))

    def _tools_back(self) -> None:
        """Sequences whose tool call has returned by now join the queue again."""
        while self._tools and self._tools[0][0] <= self.t:
            _, _, seq = heapq.heappop(self._tools)
            self.waiting.append(seq)
            self._next = None  # its admission (and prefill) changes the next end

    def advance_to(self, now: float) -> None:
        """Take every whole step that ends by `now`."""
        while True:
            if self.paused_until > self.t:
                if self.paused_until > now:
                    break
                self.t, self._next = self.paused_until, None
            self._tools_back()
            self._admit()
            # A tool call that returns before `now` is a change: step up to it first.
            until = min(now, self._tools[0][0]) if self._tools else now
            if not self.running:
                if until > self.t:
                    self.idle_s += until - self.t
                    self.t, self._next = until, None
                if until < now:
                    continue
                return
            b = len(self.running)
            steps = min(self._steps_to_next_change(),
                        # A nanosecond's slack: `now` may be this engine's own
                        # next_time, computed the other way round in floats.
                        self.decode.steps_within(b, self.context, until - self.t + 1e-9))
            if steps == 0:
                if self._tools and self._tools[0][0] <= now:
                    # Less than a step to the tool's return: it joins at this boundary.
                    self._next = None
                    heapq.heapreplace(self._tools, (self.t, *self._tools[0][1:]))
                    continue
                return
            self._next = None
            dt = self.decode.steps_time_s(b, self.context, steps)
            kv = self.decode.kv_capacity_tokens
            self.kv_usage_s += dt * min(1.0, (self.context + b * steps / 2) / kv)
            self.occupancy_s += dt * min(1.0, b / max(1, self.cap or b))
            self.busy_s += dt
            self.t += dt
            self.counter += steps
            self.decode_steps += steps
            self.context += b * steps
            self.generated_tokens += b * steps
            self._finish_ended()
            if self.context + len(self.running) > kv:
                self._preempt()

    def load_weights(self, version: int, now: float, until: float) -> None:
        """A weight update from `now`: paused until `until`; the tokens generated
        after it are `version`'s."""
        self.advance_to(now)
        self.paused_until = max(self.paused_until, until)
        self.version = version
        self._versions.append((self.counter, version))
        self.drain(False)

    def drain(self, draining: bool) -> None:
        """Admit nothing more (True) until the update (a weight update without
        partial rollout lets the running samples finish under the old weights)."""
        self.draining = draining
        self._next = None

    @property
    def inflight(self) -> int:
        """Sequences submitted and not ended (RolloutStats.inflight_samples)."""
        return len(self.running) + len(self.waiting) + len(self._tools)

    def hand_back(self) -> int:
        """Abort every group not yet put, as a worker leaving rollout does with
        `cluster.flip_inflight: return`: its sequences leave the batch (their tokens
        are lost) and each group's end event says GROUP_RETURNED, so the dispatcher
        routes its prompt again. Returns the groups handed back."""
        for key, seq in list(self.running.items()):
            self.context -= seq.context + (self.counter - seq.run_start)
            del self.running[key]
        self.waiting.clear()
        self._tools.clear()
        self._ends.clear()
        returned = list(self.groups)
        for gid in returned:
            del self.groups[gid]
            self._seq += 1
            self.events.append(SampleEvent(self._seq, gid, -1, policy_version=self.version,
                                           error=GROUP_RETURNED))
        self._next = None
        return len(returned)

    # --- internals --------------------------------------------------------------------

    def _steps_to_next_change(self) -> int:
        while self._ends and (self._ends[0][1], self._ends[0][2]) not in self.running:
            heapq.heappop(self._ends)  # preempted since
        to_end = self._ends[0][0] - self.counter
        room = (self.decode.kv_capacity_tokens - self.context) // max(1, len(self.running))
        return max(1, min(to_end, room))

    def _admit(self) -> None:
        if self.draining or self.paused_until > self.t:
            return
        kv = self.decode.kv_capacity_tokens
        while self.waiting and len(self.running) < self.decode.max_running_sequences:
            seq = self.waiting[0]
            need = seq.prompt_tokens + seq.generated
            if self.context + need + 1 > kv and self.running:
                break
            self.waiting.pop(0)
            seq.run_start, seq.context, seq.admitted = self.counter, need, True
            self.running[(seq.group_id, seq.index)] = seq
            self.context += need
            heapq.heappush(self._ends, (self.counter + seq.stop - seq.generated,
                                        seq.group_id, seq.index))
            # Prefill (a preempted sequence recomputes its tokens too; one back from
            # a tool call only the tool's output).
            prefill_s = (need - seq.cached) * self.decode.prefill_per_token_us / 1e6
            self.t += prefill_s
            self.busy_s += prefill_s
            seq.cached = 0

    def _run_segments(self, seq: _Seq) -> list[list[int]]:
        """The versions of the tokens of `seq`'s current run."""
        end = self.counter
        out: list[list[int]] = []
        for i, (at, version) in enumerate(self._versions):
            nxt = self._versions[i + 1][0] if i + 1 < len(self._versions) else math.inf
            lo, hi = max(at, seq.run_start), min(nxt, end)
            if hi > lo:
                out.append([version, hi - lo])
        return out

    def _finish_ended(self) -> None:
        while self._ends and self._ends[0][0] <= self.counter:
            _, gid, index = heapq.heappop(self._ends)
            seq = self.running.pop((gid, index), None)
            if seq is None:
                continue
            seq.done_segments += self._run_segments(seq)
            if seq.turn_ends:
                # A turn ends in a tool call: out of the batch until it returns.
                self.context -= seq.context + (self.counter - seq.run_start)
                seq.generated = seq.turn_ends.pop(0)
                seq.cached = seq.prompt_tokens + seq.generated
                seq.prompt_tokens += self.costs.tools.output_tokens
                seq.admitted = False
                self._seq_tool += 1
                heapq.heappush(self._tools, (self.t + self.costs.tools.latency_s(self.rng),
                                             self._seq_tool, seq))
                continue
            seq.generated = seq.target
            self.sample_tokens[f"{gid}-{index}"] = (seq.prompt_tokens, seq.target)
            self.context -= seq.context + (self.counter - seq.run_start)
            self.finished_samples += 1
            self._seq += 1
            self.events.append(SampleEvent(self._seq, gid, index, seq.target, seq.prompt_tokens,
                                           self.version))
            group = self.groups[gid]
            group.left -= 1
            if group.left == 0:
                self._put(gid, group)

    def _preempt(self) -> None:
        """Recompute preemption: the newest running sequence leaves the cache and
        waits at the head of the queue with what it generated."""
        key = max(self.running, key=lambda k: self.running[k].run_start)
        seq = self.running.pop(key)
        seq.done_segments += self._run_segments(seq)
        ran = self.counter - seq.run_start
        self.context -= seq.context + ran
        seq.generated += ran
        seq.admitted = False
        self.waiting.insert(0, seq)
        self.preemptions += 1

    def _put(self, gid: str, group: _Group) -> None:
        del self.groups[gid]
        rewards = [1.0 if self.rng.random() < group.reward_p else 0.0 for _ in group.members]
        trajectories = []
        for seq, reward, adv in zip(group.members, rewards,
                                    self.scoring.estimator.compute(rewards)):
            # One placeholder token a segment: the buffer sees each sample's versions;
            # its length lives with the simulation (Simulation.tokens).
            segments = [Segment(v, 1) for v, _ in _merged(seq.done_segments)]
            n = len(segments)
            trajectories.append(Trajectory(
                sample_id=f"{gid}-{seq.index}", group_id=gid, prompt_ids=[0], response_ids=[0] * n,
                logprobs=[0.0] * n, loss_mask=[1] * n, segments=segments, reward=reward,
                advantage=adv, created_at=self.t))
        filtered = self.scoring.drops(trajectories)
        if filtered:
            self.filtered_groups += 1
        else:
            self.replay.put(self.job_id, trajectories)
        self._seq += 1
        self.events.append(SampleEvent(self._seq, gid, -1, policy_version=self.version,
                                       error=GROUP_FILTERED if filtered else ""))


def _merged(segments: list[list[int]]) -> list[list[int]]:
    out: list[list[int]] = []
    for version, n in segments:
        if out and out[-1][0] == version:
            out[-1][1] += n
        else:
            out.append([version, n])
    return out
