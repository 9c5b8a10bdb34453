"""One multi-turn episode, generated token-in/token-out (paper §4.1 step 2,
multi-turn): the policy's turns and the environment's observations
interleaved into one response, with the mask that keeps observations out of
the loss.

The sequence the trainer sees is the first prompt's tokens followed by every
turn's policy tokens and the observation tokens between them, exactly as the
engine was given them: the policy's own tokens are never decoded and encoded
again, so their behaviour logprobs stay theirs. Every policy token keeps the
version segment of the weights that sampled it, so an episode that spans a
weight sync carries each turn's versions. Observation tokens have loss mask 0,
logprob 0.0, and the version loaded when they were appended.

This module owns the episode loop and its limits. It knows nothing of which
engine generates, how a chat template looks (the renderer does), what the
environment computes, or what happens to a failed episode (the rollout worker
decides: `reward_error`).
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from reflow.core.types import Segment
from reflow.rollout.engine import SamplingSpec, TokenDelta
from reflow.rollout.records import PartialSample
from reflow.tasks.base import Environment, EpisodeLimits, StepResult  # noqa: F401 - re-exported

logger = logging.getLogger(__name__)

# reward_error values; "" means the episode was scored.
ENV_EXCEPTION = "env_exception"
ENV_TIMEOUT = "env_timeout"
NON_FINITE = "non_finite"


@dataclass
class EpisodeResult:
    """A finished episode, ready to become a `Trajectory` (same field meanings)."""

    prompt_ids: list[int]
    response_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    # 1 for policy tokens, 0 for observation tokens.
    loss_mask: list[int] = field(default_factory=list)
    segments: list[Segment] = field(default_factory=list)
    # The sum of the environment's step rewards; 0.0 when reward_error is set.
    reward: float = 0.0
    # "" (scored), "env_exception", "env_timeout" or "non_finite".
    reward_error: str = ""
    num_turns: int = 0
    tool_calls: int = 0
    tool_seconds: float = 0.0
    # "stop": the environment ended it (or failed: see reward_error); "length": a
    # limit did (turns, tokens, time); "abort": generation was aborted, or the
    # environment failed to reset (then prompt_ids is empty: nothing to train on).
    finish_reason: str = "stop"
    # Seconds spent in environment steps, for the metrics.
    env_seconds: float = 0.0
    # Each policy turn's min_tokens (SamplingSpec.min_tokens; a turn with fewer
    # tokens left has them all under it): core.types.Trajectory.min_tokens.
    min_tokens: int = 0

    @property
    def num_policy_tokens(self) -> int:
        return sum(self.loss_mask)


class Renderer(Protocol):
    """What the loop needs of a chat template (reflow.tasks.chat.ChatRenderer)."""

    def prompt_ids(self, messages: list[dict[str, Any]],
                   tools: list[dict[str, Any]] | None = None) -> list[int]: ...

    def continuation_ids(self, message: dict[str, Any], policy_stopped: bool) -> list[int]: ...

    def ends_turn(self, token_ids: list[int]) -> bool: ...

    def decode(self, token_ids: list[int]) -> str: ...


Generate = Callable[[str, list[int], SamplingSpec], AsyncIterator[TokenDelta]]


class _EnvFailed(Exception):
    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


async def _call_env(fn: Callable[..., Any], *args: Any, timeout_s: float, what: str,
                    request_id: str) -> Any:
    """Run an environment call off the event loop (it is the engine's output loop
    too), bounded. A call that overruns keeps its thread until it returns: Python
    cannot stop a thread, so a hung environment costs one default-executor thread."""
    try:
        return await asyncio.wait_for(asyncio.to_thread(fn, *args), timeout=max(timeout_s, 0.0))
    except TimeoutError:
        logger.warning("episode %s: environment %s took over %.1fs", request_id, what, timeout_s)
        raise _EnvFailed(ENV_TIMEOUT) from None
    except Exception:
        logger.exception("episode %s: environment %s raised", request_id, what)
        raise _EnvFailed(ENV_EXCEPTION) from None


async def _generate_turn(generate: Generate, request_id: str, prompt_ids: list[int],
                         sampling: SamplingSpec, sample: PartialSample, mask: list[int],
                         current_version: Callable[[], int]) -> tuple[list[int], str]:
    """Generate one policy turn onto `sample`; its tokens and finish reason."""
    start = len(sample.response_ids)
    finish_reason = "length"
    async for delta in generate(request_id, prompt_ids, sampling):
        sample.extend(delta.token_ids, delta.logprobs,
                      delta.segments or [(current_version(), len(delta.token_ids))])
        mask.extend([1] * len(delta.token_ids))
        if delta.finished:
            finish_reason = delta.finish_reason or "stop"
    return sample.response_ids[start:], finish_reason


async def run_episode(generate: Generate, request_id: str, env: Environment,
                      renderer: Renderer, system_prompt: str | None,
                      tools: list[dict[str, Any]] | None, sampling: SamplingSpec,
                      limits: EpisodeLimits, current_version: Callable[[], int]) -> EpisodeResult:
    """Play one episode of `env` with the policy behind `generate`.

    Each turn is one engine request, `f"{request_id}-t{turn}"`, on the prompt plus
    everything generated and observed so far; its `max_tokens` is the smaller of
    `sampling.max_tokens` and the tokens the episode has left. Environment
    failures never raise: they end the episode with `reward_error` set. A chat
    template that cannot render an observation raises ValueError (the renderer's):
    that is the job's configuration, the same for every episode.
    """
    started = time.monotonic()
    deadline = started + limits.episode_timeout_s
    # 1. The first observation is the first user message.
    try:
        first = await _call_env(env.reset, timeout_s=min(limits.turn_timeout_s,
                                                         limits.episode_timeout_s),
                                what="reset", request_id=request_id)
    except _EnvFailed as failed:
        # Nothing to train on: no prompt was posed. The worker drops it.
        return EpisodeResult(prompt_ids=[], reward_error=failed.reason, finish_reason="abort")
    messages = [{"role": "system", "content": system_prompt}] if system_prompt else []
    messages.append({"role": "user", "content": str(first)})
    prompt_ids = renderer.prompt_ids(messages, tools)

    sample = PartialSample()
    mask: list[int] = []
    result = EpisodeResult(prompt_ids=prompt_ids, min_tokens=sampling.min_tokens)
    rewards: list[float] = []
    # The last observation joins the sequence only when a policy turn follows it:
    # trailing observation tokens would carry no signal.
    pending: list[int] = []
    for turn in range(limits.max_turns):
        # 2. One policy turn, within the episode's token and time budgets.
        tokens_left = limits.max_episode_tokens - len(sample.response_ids) - len(pending)
        if tokens_left <= 0 or time.monotonic() >= deadline:
            result.finish_reason = "length"
            break
        if pending:
            sample.extend(pending, [0.0] * len(pending), [(current_version(), len(pending))])
            mask.extend([0] * len(pending))
            pending = []
        max_tokens = min(sampling.max_tokens, tokens_left)
        turn_sampling = replace(sampling, max_tokens=max_tokens,
                                min_tokens=min(sampling.min_tokens, max_tokens))
        turn_ids, turn_finish = await _generate_turn(
            generate, f"{request_id}-t{turn}", prompt_ids + sample.response_ids, turn_sampling,
            sample, mask, current_version)
        result.num_turns = turn + 1
        if turn_finish == "abort":
            result.finish_reason = "abort"
            break

        # 3. The environment answers the turn, off the loop and bounded.
        step_started = time.monotonic()
        time_left = deadline - step_started
        if time_left <= 0:
            result.finish_reason = "length"
            break
        try:
            step = await _call_env(env.step, renderer.decode(turn_ids),
                                   timeout_s=min(limits.turn_timeout_s, time_left),
                                   what=f"step {turn}", request_id=request_id)
            reward, tool_calls, tool_seconds = _step_outcome(step, request_id, turn)
        except _EnvFailed as failed:
            if failed.reason == ENV_TIMEOUT and time_left < limits.turn_timeout_s:
                # The episode's time ran out, not the step's: a budget, like tokens.
                result.finish_reason = "length"
            else:
                result.reward_error, result.finish_reason = failed.reason, "stop"
            break
        finally:
            result.env_seconds += time.monotonic() - step_started
        rewards.append(reward)
        result.tool_calls += tool_calls
        result.tool_seconds += tool_seconds
        if step.done:
            result.finish_reason = "stop"
            break

        if turn + 1 == limits.max_turns:
            result.finish_reason = "length"
            break
        # 4. The observation, outside the loss (mask 0, logprob 0.0).
        pending = renderer.continuation_ids(
            {"role": str(step.role), "content": str(step.observation)},
            policy_stopped=renderer.ends_turn(turn_ids))

    result.response_ids, result.logprobs = sample.response_ids, sample.logprobs
    result.segments, result.loss_mask = sample.segments, mask
    result.reward = 0.0 if result.reward_error else float(sum(rewards))
    return result


def _step_outcome(step: Any, request_id: str, turn: int) -> tuple[float, int, float]:
    """(reward, tool calls, tool seconds) of a step, or _EnvFailed for a result
    that is not a StepResult of numbers, or whose reward is NaN or infinite."""
    if not isinstance(step, StepResult):
        logger.error("episode %s: step %d returned %s, not a StepResult", request_id, turn,
                     type(step).__name__)
        raise _EnvFailed(ENV_EXCEPTION)
    try:
        reward = float(step.reward)
        tool_calls, tool_seconds = int(step.tool_calls), float(step.tool_seconds)
    except (TypeError, ValueError, OverflowError):
        logger.error("episode %s: step %d reward %r or tool counts are not numbers", request_id,
                     turn, step.reward)
        raise _EnvFailed(ENV_EXCEPTION) from None
    if not math.isfinite(reward):
        logger.warning("episode %s: step %d reward is %s", request_id, turn, reward)
        raise _EnvFailed(NON_FINITE)
    return reward, tool_calls, tool_seconds
