"""What a rollout worker keeps as it generates: each sample's tokens and version
segments so far, its counters, and the sample events the job's dispatcher reads
(reflow.scheduler.generation.dispatch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from reflow.core.types import Segment


@dataclass
class WeightUpdate:
    """How long a rollout worker took to take a new version: `pause_s` until its
    engine stopped generating (with partial rollout off, its samples in flight
    finishing under the old weights first), `receive_s` loading the weights."""

    pause_s: float
    receive_s: float


@dataclass
class PartialSample:
    """A sample being generated: tokens, logprobs and version segments so far,
    and the min_tokens it is generated under (SamplingSpec.min_tokens), which its
    Trajectory carries: its first min_tokens logprobs are of a law without the
    stop tokens (core.types.Trajectory.min_tokens)."""

    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    finish_reason: str = "length"
    min_tokens: int = 0

    def extend(self, ids: list[int], logprobs: list[float],
               versions: list[tuple[int, int]]) -> None:
        """Append tokens and their (policy version, tokens) segments."""
        if sum(n for _, n in versions) != len(ids):
            raise ValueError(f"version segments {versions} do not cover {len(ids)} tokens")
        self.response_ids += ids
        self.logprobs += logprobs
        for version, n in versions:
            if self.segments and self.segments[-1].policy_version == version:
                last = self.segments[-1]
                self.segments[-1] = Segment(version, last.num_tokens + n)
            elif n:
                self.segments.append(Segment(version, n))


@dataclass
class RolloutCounters:
    generated_tokens_total: int = 0
    finished_samples_total: int = 0
    idle_seconds_total: float = 0.0
    inflight_samples: int = 0
    policy_version: int = 0
    # Engine batch occupancy integrated over time (see _measure_occupancy).
    occupancy_seconds_total: float = 0.0
    # Seconds the engine had a request running, unpaused (see _measure_occupancy).
    engine_busy_seconds_total: float = 0.0
    # Engine steps that generated tokens, where the engine counts them (EngineLoad).
    engine_decode_steps_total: int = 0
    # Seconds the engine took to build: start-up, reported apart from the steady state.
    engine_startup_s: float = 0.0
    # The engine's KV-cache use integrated over time (its rate is the mean use),
    # and the requests it preempted for room: the concurrency controller's inputs
    # (§6.1). Preemptions of a weight update (the pause drops every running
    # request's KV cache) are counted apart: they say nothing about congestion.
    kv_usage_seconds_total: float = 0.0
    preempted_requests_total: int = 0
    sync_preempted_requests_total: int = 0
    # The engine's KV-cache capacity in tokens (Budget_i of §6.1); 0 when unknown.
    kv_cache_tokens: int = 0
    # The concurrency cap the dispatcher last gave this worker.
    concurrency_cap: int = 0
    # Samples scored, and those without a reward by reason (rollout/scoring.py).
    scored_samples_total: int = 0
    reward_errors_total: dict[str, int] = field(default_factory=dict)
    # Groups dynamic sampling dropped: rewards all equal, never put (rollout/scoring.py).
    filtered_groups_total: int = 0


@dataclass(frozen=True)
class SampleEvent:
    """What the dispatcher learns from a worker: a sample ended (`sample_index`
    >= 0, with its token counts), or a group was put to the buffer
    (`sample_index` -1; `error` set if it failed instead, or GROUP_RETURNED or
    GROUP_FILTERED if it ended without a put)."""

    seq: int
    group_id: str
    sample_index: int
    response_tokens: int = 0
    prompt_tokens: int = 0
    policy_version: int = 0
    error: str = ""


# The error of a group's end event when its worker handed it back unfinished.
GROUP_RETURNED = "returned: its worker left the rollout role"
# ... when dynamic sampling dropped it (algorithm.dynamic_sampling: its scored
# rewards were all equal); the dispatcher spends its grant on a new prompt.
GROUP_FILTERED = "filtered: its rewards were all equal (algorithm.dynamic_sampling)"
