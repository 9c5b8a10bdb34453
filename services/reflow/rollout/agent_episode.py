"""One agent episode (task `agent`, reflow.tasks.agent): an agent program, started
per episode, calls the policy through an OpenAI-compatible endpoint
(rollout/agent_endpoint.py), and the episode becomes one trajectory, token-in/
token-out like any multi-turn episode (rollout/episode.py).

Each call's messages are rendered with the model's chat template, and the
rendering must extend the tokens so far (the previous prompt and the previous
completion, exactly as the engine generated them). If the previous completion
ended on a stop token, the template's end-of-turn token stands in its place,
as in ChatRenderer.continuation_ids; if it was cut at its length, the template
closes the turn itself. What the rendering adds after those tokens (the end of
the assistant turn, the agent's new messages, the next assistant header) joins
the sequence with loss mask 0 and logprob 0.0; the completion is the engine's,
with its logprobs and version segments. A rendering that does not extend the
sequence (the template renders an earlier assistant turn differently, the
agent editing or branching its history, a completion whose text re-tokenizes
differently) ends the episode with `agent_retokenized`: that sample is never
trained on. The last case alone, the same text under other tokens (a sampled
tokenization that is not the tokenizer's own: `\n` `\n` for `\n\n`), may go on
instead with the task's `retokenization: keep_sampled`: the sequence keeps the
tokens as sampled, the rendering's tokens after that turn's end are the
observation, and the trajectory is still exactly what the engine saw.

The agent runs under bubblewrap (reflow.rollout.agent_process: a view of the
system, its interpreter and its own code, a pid namespace of its own, the
worker's network, limits) with a scrubbed environment (PATH, a scratch HOME and
working directory, OPENAI_BASE_URL and a per-episode OPENAI_API_KEY), and is
killed when the episode ends, whatever ended it: its exit, a refused call, a
limit, the episode timeout, or the group being cancelled. Its input is JSON on
stdin (AgentTask.agent_input).

This module knows nothing of HTTP (the endpoint's) nor of how a group becomes
the buffer's (the worker's).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
import time
from dataclasses import dataclass, replace

from reflow.rollout.agent_endpoint import AgentEndpoint, ChatRequest, Completion, RequestError
from reflow.rollout.agent_process import AgentExit, AgentLauncher
from reflow.rollout.engine import SamplingSpec
from reflow.rollout.episode import EpisodeResult, Generate
from reflow.rollout.multiturn import EpisodeCounters
from reflow.rollout.records import PartialSample
from reflow.rollout.scoring import GroupScoring, Scorer, group_trajectories
from reflow.tasks.agent import resolve_agent
from reflow.tasks.rewards import RewardPool, RewardResult

logger = logging.getLogger(__name__)

# reward_error values of an agent episode (besides the scorer's own).
AGENT_RETOKENIZED = "agent_retokenized"
AGENT_TIMEOUT = "agent_timeout"
AGENT_FAILED = "agent_failed"
AGENT_NO_CALLS = "agent_no_calls"
AGENT_NO_REWARD = "agent_no_reward"
AGENT_PROMPT_MISMATCH = "agent_prompt_mismatch"


class AgentEpisode:
    """The calls of one episode: the sequence so far, the checks every call
    passes, and the limits. Calls are served one at a time."""

    def __init__(self, renderer, generate: Generate, request_id: str, sampling: SamplingSpec,
                 max_calls: int, max_episode_tokens: int, current_version,
                 keep_sampled: bool = False) -> None:
        self.renderer, self.generate, self.request_id = renderer, generate, request_id
        self.sampling = sampling
        self.max_calls, self.max_episode_tokens = max_calls, max_episode_tokens
        # Same text, other tokens: go on from the sampled tokens (True) or refuse.
        self.keep_sampled = keep_sampled
        self.num_kept = 0
        self.current_version = current_version
        self.prompt_ids: list[int] = []
        self.sample = PartialSample(min_tokens=sampling.min_tokens)
        self.mask: list[int] = []
        self.num_calls = 0
        self.call_seconds = 0.0
        # Whether the last completion ended on a stop token, and its text.
        self.stopped = False
        self.last_text = ""
        # What ended the episode early: a reward_error, or a finish reason.
        self.error = ""
        self.finish_reason = "stop"
        self.engine_error: Exception | None = None
        self.ended = asyncio.Event()
        self._lock = asyncio.Lock()

    def _end(self, error: str = "", finish_reason: str = "stop") -> None:
        self.error, self.finish_reason = error, finish_reason
        self.ended.set()

    async def complete(self, call: ChatRequest) -> Completion:
        async with self._lock:
            if self.ended.is_set():
                raise RequestError(400, "the episode has ended", code="episode_ended")
            started = time.monotonic()
            try:
                return await self._complete(call)
            finally:
                self.call_seconds += time.monotonic() - started

    async def _complete(self, call: ChatRequest) -> Completion:
        # 1. The call's messages as the model sees them.
        try:
            ids = self.renderer.prompt_ids(call.messages, call.tools)
        except Exception as err:  # noqa: BLE001 - a template's refusal, any type
            raise RequestError(400, f"messages: the chat template cannot render them ({err})"[:500],
                               param="messages") from None
        # 2. They extend what was generated, token for token.
        observation = self._extension(ids)
        # 3. Within the limits: calls, then the episode's tokens.
        left = self.max_episode_tokens - len(self.sample.response_ids) - len(observation)
        if self.num_calls >= self.max_calls or left <= 0:
            what = "max_calls" if self.num_calls >= self.max_calls else "max_episode_tokens"
            self._end(finish_reason="length")
            raise RequestError(400, f"the episode's {what} is spent", code=what)
        if not self.prompt_ids:
            self.prompt_ids = ids
        elif observation:
            self.sample.extend(observation, [0.0] * len(observation),
                               [(self.current_version(), len(observation))])
            self.mask += [0] * len(observation)
        # 4. One completion, under the job's sampling law, within both budgets.
        max_tokens = min(call.max_tokens or self.sampling.max_tokens, self.sampling.max_tokens,
                         left)
        sampling = replace(self.sampling, max_tokens=max_tokens,
                           min_tokens=min(self.sampling.min_tokens, max_tokens))
        prompt = self.prompt_ids + self.sample.response_ids
        start, finish = len(self.sample.response_ids), "length"
        request_id = f"{self.request_id}-c{self.num_calls}"
        self.num_calls += 1
        try:
            async with contextlib.aclosing(self.generate(request_id, prompt,
                                                         sampling)) as deltas:
                async for delta in deltas:
                    self.sample.extend(delta.token_ids, delta.logprobs, delta.segments or [
                        (self.current_version(), len(delta.token_ids))])
                    self.mask += [1] * len(delta.token_ids)
                    if delta.finished:
                        finish = delta.finish_reason or "stop"
        except Exception as err:
            # The engine's failure is the worker's, as in any episode: play() raises it.
            self.engine_error = err
            self._end(finish_reason="abort")
            raise
        if finish == "abort":
            self._end(finish_reason="abort")
            raise RequestError(503, "generation was aborted", code="aborted", kind="server_error")
        completion = self.sample.response_ids[start:]
        self.stopped = self.renderer.ends_turn(completion)
        self.last_text = self._decode(completion[:-1] if self.stopped else completion)
        logprobs = None
        if call.logprobs:
            logprobs = [(self._decode([t]), lp) for t, lp in
                        zip(completion, self.sample.logprobs[start:])]
        return Completion(self.last_text, "stop" if finish == "stop" else "length", len(prompt),
                          len(completion), logprobs)

    def _extension(self, ids: list[int]) -> list[int]:
        """The tokens `ids` add to the sequence so far; refuses (and ends the
        episode) when they do not extend it."""
        if not self.prompt_ids:
            return []
        sequence = self.prompt_ids + self.sample.response_ids
        n = len(sequence)
        # The policy's own stop token stands for the template's end of turn.
        kept = n - 1 if self.stopped else n
        extends = (len(ids) > n and ids[:kept] == sequence[:kept]
                   and (not self.stopped or ids[n - 1] in self.renderer.stop_token_ids))
        if extends:
            return ids[n:]
        if self.keep_sampled:
            observation = self._same_text_extension(ids, sequence[:kept])
            if observation is not None:
                self.num_kept += 1
                return observation
        at = next((i for i, (a, b) in enumerate(zip(ids, sequence)) if a != b), min(len(ids), n))
        logger.warning("agent episode %s: call %d does not extend the tokens so far (at token "
                       "%d of %d: %r)", self.request_id, self.num_calls, at, n,
                       self._decode(sequence[max(0, at - 8):at + 8]))
        self._end(AGENT_RETOKENIZED)
        raise RequestError(400, f"messages: the rendered conversation differs at token {at} from "
                           "the tokens generated so far (an earlier turn edited, or re-rendered "
                           "differently by the chat template); the sample is refused",
                           param="messages", code=AGENT_RETOKENIZED)

    def _same_text_extension(self, ids: list[int], sampled: list[int]) -> list[int] | None:
        """What `ids` add after `sampled` when their text up to an end-of-turn token is
        the text of `sampled` (special tokens included) though their tokens are not:
        the turn closes there, so the tokens after it are the agent's alone. None if
        no end of turn follows that text."""
        text = self._decode(sampled, skip_special_tokens=False)
        for j, token in enumerate(ids):
            if token not in self.renderer.stop_token_ids:
                continue
            before = self._decode(ids[:j], skip_special_tokens=False)
            if before == text:
                # A policy stop token stands for this one; else the template's closes the turn.
                return ids[j + 1:] if self.stopped else ids[j:]
            if len(before) > len(text):
                return None
        return None

    def _decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.renderer.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens,
                                              clean_up_tokenization_spaces=False)


def reported_reward(stdout: bytes) -> RewardResult:
    """The agent's own reward: its last non-empty stdout line, `{"reward": x}`."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    try:
        value = json.loads(lines[-1])["reward"]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError
    except (IndexError, ValueError, KeyError, TypeError, RecursionError):
        return RewardResult(0.0, AGENT_NO_REWARD, "no last line {\"reward\": <number>}")
    if not math.isfinite(value):
        return RewardResult(0.0, "non_finite", repr(value))
    return RewardResult(float(value))


@dataclass
class AgentCounters(EpisodeCounters):
    """A multi-turn worker's counters (turns: calls), and the calls that went on
    from their sampled tokens (`retokenization: keep_sampled`)."""

    kept_retokenized_total: int = 0


class AgentRunner:
    """Plays an agent task's episodes on the worker's engine (the interface of
    rollout.multiturn.EpisodeRunner). With `reward_source: task` the final
    assistant message is scored by `score`, by default a reward pool of its own
    (math-verify needs a process's main thread), which `close` ends."""

    def __init__(self, task, renderer, spec=None, score: Scorer | None = None) -> None:
        self.task, self.renderer = task, renderer
        self.counters = AgentCounters()
        self.program = resolve_agent(task.args.agent)
        self.launcher = AgentLauncher(self.program, task.args)
        self._pool: RewardPool | None = None
        if score is None and task.args.reward_source == "task":
            if spec is None:
                raise ValueError("an agent task scored by the task needs the job's spec or a scorer")
            self._pool = RewardPool(spec.task.name, spec.task.args, task.context,
                                    spec.task.reward_workers, spec.task.reward_timeout_s,
                                    limits=spec.task.reward_limits)
            score = self._pool.score
        self.score = score

    async def play(self, generate: Generate, request_id: str, prompt, sampling: SamplingSpec,
                   current_version) -> EpisodeResult:
        args = self.task.args
        started = time.monotonic()
        episode = AgentEpisode(self.renderer, generate, request_id, sampling, args.max_calls,
                               args.max_episode_tokens, current_version,
                               keep_sampled=args.retokenization == "keep_sampled")
        api_key = secrets.token_urlsafe(32)
        endpoint = AgentEndpoint(episode.complete, api_key, args.max_request_bytes)
        try:
            base_url = await endpoint.start()
            given = json.dumps(self.task.agent_input(prompt)).encode() + b"\n"
            done = await self.launcher.run(given, base_url, api_key, args.episode_timeout_s,
                                           episode.ended)
        finally:
            await endpoint.close()
        if episode.engine_error is not None:
            raise episode.engine_error
        result = await self._result(episode, done, prompt, request_id)
        c = self.counters
        c.episodes_total += 1
        c.turns_total += result.num_turns
        c.kept_retokenized_total += episode.num_kept
        c.env_seconds_total += max(0.0, time.monotonic() - started - episode.call_seconds)
        return result

    async def _result(self, episode: AgentEpisode, done: AgentExit, prompt,
                      request_id: str) -> EpisodeResult:
        s = episode.sample
        result = EpisodeResult(prompt_ids=list(episode.prompt_ids),
                               response_ids=list(s.response_ids), logprobs=list(s.logprobs),
                               loss_mask=list(episode.mask), segments=list(s.segments),
                               num_turns=episode.num_calls, finish_reason=episode.finish_reason,
                               min_tokens=episode.sampling.min_tokens)
        if episode.error:
            outcome = RewardResult(0.0, episode.error)
        elif done.timed_out:
            outcome = RewardResult(0.0, AGENT_TIMEOUT)
        elif not episode.ended.is_set() and done.returncode != 0:
            outcome = RewardResult(0.0, AGENT_FAILED, f"exit status {done.returncode}")
        elif not episode.num_calls:
            outcome = RewardResult(0.0, AGENT_NO_CALLS)
        elif self.task.args.reward_source == "task":
            outcome = await asyncio.to_thread(self.score, prompt, episode.last_text)
        elif episode.ended.is_set():
            outcome = RewardResult(0.0)  # cut by a limit: the agent never reported
        else:
            outcome = reported_reward(done.stdout)
        if outcome.error:
            logger.warning("agent episode %s: %s %s; stderr: %s", request_id, outcome.error,
                           outcome.message,
                           done.stderr.decode(errors="replace")[-1000:])
        if not result.prompt_ids:
            # Nothing was posed: the task's own first prompt stands in (all masked).
            result.prompt_ids = self.renderer.prompt_ids(self.task.prompt_messages(prompt))
        result.reward, result.reward_error = outcome.value, outcome.error
        return result

    def trajectories(self, group_id: str, episodes: list[EpisodeResult],
                     scoring: GroupScoring | None = None):
        """The group's trajectories and reward results. Agents pose their own first
        prompts, which may differ between members: the group's prompt is their
        longest common prefix, and the rest of each member's first prompt leads its
        response, masked. A member that made no call stands with an empty response."""
        posed = [e.prompt_ids for e in episodes if e.num_turns]
        common = _common_prefix(posed) if posed else episodes[0].prompt_ids
        if not common and posed:
            common = posed[0]
        members, results = [], []
        for e in episodes:
            result = RewardResult(e.reward, e.reward_error)
            if not e.num_turns:
                e = replace(e, response_ids=[], logprobs=[], loss_mask=[], segments=[])
            elif e.prompt_ids[:len(common)] != common:
                e = replace(e, response_ids=[], logprobs=[], loss_mask=[], segments=[])
                result = RewardResult(0.0, AGENT_PROMPT_MISMATCH)
            elif len(e.prompt_ids) > len(common):
                tail = e.prompt_ids[len(common):]
                joined = PartialSample()
                version = e.segments[0].policy_version if e.segments else 0
                joined.extend(tail, [0.0] * len(tail), [(version, len(tail))])
                joined.extend(e.response_ids, e.logprobs,
                              [(seg.policy_version, seg.num_tokens) for seg in e.segments])
                e = replace(e, response_ids=joined.response_ids, logprobs=joined.logprobs,
                            loss_mask=[0] * len(tail) + e.loss_mask, segments=joined.segments)
            members.append(e)
            results.append(result)
        return group_trajectories(group_id, common, members, results,
                                  loss_masks=[e.loss_mask for e in members], scoring=scoring,
                                  max_tokens=self.task.args.max_episode_tokens), results

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
            self._pool = None


def _common_prefix(sequences: list[list[int]]) -> list[int]:
    first = sequences[0]
    n = len(first)
    for other in sequences[1:]:
        n = next((i for i, (a, b) in enumerate(zip(first[:n], other)) if a != b),
                 min(n, len(other)))
    return first[:n]
