"""The multi-turn episode loop against a scripted engine: what reaches the
trainer (tokens, loss mask, logprobs, version segments), the limits, and
environments that fail."""

import asyncio
import logging
import time

import pytest

from reflow.core.types import Segment, Trajectory
from reflow.rollout.engine import SamplingSpec, TokenDelta
from reflow.rollout.episode import EpisodeLimits, EpisodeResult, run_episode
from reflow.tasks.base import StepResult
from reflow.tasks.calculator import CalculatorEnv, CalculatorTask
from reflow.tasks.chat import ChatRenderer
from reflow.tasks.games import GuessNumberEnv
from tests.unit.chat_tokenizer import build_chat_tokenizer

TOKENIZER = build_chat_tokenizer()
RENDERER = ChatRenderer(TOKENIZER)
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
SAMPLING = SamplingSpec(max_tokens=64, temperature=1.0, seed=1)


def turn(text, stop=True, logprob=-0.5, segments=None, chunk=3, finish_reason=None):
    """A policy turn as an engine streams it: deltas of `chunk` tokens; `segments`
    (one list per delta) when the engine labels versions itself."""
    ids = TOKENIZER.encode(text, add_special_tokens=False) + ([IM_END] if stop else [])
    deltas = []
    for k, start in enumerate(range(0, len(ids), chunk)):
        part = ids[start:start + chunk]
        deltas.append(TokenDelta(part, [logprob - 0.01 * (start + i) for i in range(len(part))],
                                 segments=segments[k] if segments else None))
    deltas[-1].finished = True
    deltas[-1].finish_reason = finish_reason or ("stop" if stop else "length")
    return deltas


class ScriptedEngine:
    """Generates the scripted turns in order, within each request's max_tokens,
    and records the requests; `before_turn[k]` runs as turn k starts."""

    def __init__(self, turns, before_turn=None):
        self.turns = list(turns)
        self.before_turn = before_turn or {}
        self.requests = []

    async def generate(self, request_id, prompt_ids, sampling):
        k = len(self.requests)
        self.requests.append((request_id, list(prompt_ids), sampling))
        if k in self.before_turn:
            self.before_turn[k]()
        left = sampling.max_tokens
        for delta in self.turns[k]:
            await asyncio.sleep(0)
            if len(delta.token_ids) >= left and not (delta.finished
                                                     and len(delta.token_ids) == left):
                yield TokenDelta(delta.token_ids[:left], delta.logprobs[:left], finished=True,
                                 finish_reason="length")
                return
            left -= len(delta.token_ids)
            yield delta


class Version:
    def __init__(self, value=0):
        self.value = value

    def __call__(self):
        return self.value


def play(engine, env, limits=None, system_prompt="Play.", tools=None,
         sampling=SAMPLING, version=None) -> EpisodeResult:
    return asyncio.run(run_episode(engine.generate, "ep", env, RENDERER, system_prompt, tools,
                                   sampling, limits or EpisodeLimits(), version or Version(0)))


def trajectory(result):
    """The invariants the trainer relies on hold (Trajectory checks them)."""
    return Trajectory(sample_id="s", group_id="g", prompt_ids=result.prompt_ids,
                      response_ids=result.response_ids, logprobs=result.logprobs,
                      loss_mask=result.loss_mask, segments=result.segments,
                      reward=result.reward, finish_reason=result.finish_reason)


def runs(mask):
    """The mask as (value, length) runs."""
    out = []
    for m in mask:
        if out and out[-1][0] == m:
            out[-1][1] += 1
        else:
            out.append([m, 1])
    return [tuple(r) for r in out]


class Endless:
    """Never done; every step rewards 0.5 (and sleeps `step_s`)."""

    def __init__(self, step_s=0.0):
        self.step_s = step_s
        self.actions = []

    def reset(self):
        return "Say something."

    def step(self, action):
        self.actions.append(action)
        time.sleep(self.step_s)
        return StepResult(observation="again", reward=0.5)


def test_policy_tokens_and_observations_interleave_token_in_token_out():
    guesses = ["\\boxed{10}", "I think \\boxed{20}", "\\boxed{30}", "It is \\boxed{37}"]
    engine = ScriptedEngine([turn(g) for g in guesses])
    env = GuessNumberEnv(secret=37, max_number=100, max_turns=4, intro="Guess my number.")
    result = play(engine, env)
    t = trajectory(result)

    assert (result.num_turns, result.finish_reason, result.reward_error) == (4, "stop", "")
    assert result.reward == pytest.approx(3 * 0.025 + 0.025 + 0.225)
    assert [r[0] for r in engine.requests] == ["ep-t0", "ep-t1", "ep-t2", "ep-t3"]
    prompt = TOKENIZER.decode(result.prompt_ids)
    assert prompt.startswith("<|im_start|>system\nPlay.") and "Guess my number." in prompt
    # Each turn's request is the first prompt plus everything so far, as generated.
    policy_runs = [len(TOKENIZER.encode(g, add_special_tokens=False)) + 1 for g in guesses]
    mask_runs = runs(result.loss_mask)
    assert [n for m, n in mask_runs if m == 1] == policy_runs
    assert [m for m, _ in mask_runs] == [1, 0, 1, 0, 1, 0, 1]  # no observation at the end
    offset = 0
    for k, (_, prompt_ids, _) in enumerate(engine.requests):
        assert prompt_ids == result.prompt_ids + result.response_ids[:offset]
        offset += sum(n for _, n in mask_runs[2 * k:2 * k + 2])
    # Policy tokens keep their behaviour logprobs; observations get 0.0.
    scripted = [lp for g in guesses for d in turn(g) for lp in d.logprobs]
    assert [lp for lp, m in zip(result.logprobs, result.loss_mask) if m] == scripted
    assert all(lp == 0.0 for lp, m in zip(result.logprobs, result.loss_mask) if not m)
    observation = TOKENIZER.decode([i for i, m in zip(t.response_ids, t.loss_mask) if not m])
    assert "10 is too low: the number is higher" in observation
    assert result.response_ids[-policy_runs[-1]:] == (
        TOKENIZER.encode(guesses[-1], add_special_tokens=False) + [IM_END])
    assert t.num_tokens == sum(policy_runs)
    assert t.segments == [Segment(0, len(t.response_ids))]


def test_the_policys_stop_token_is_not_repeated_and_a_cut_turn_is_closed():
    engine = ScriptedEngine([turn("\\boxed{10}", stop=True), turn("\\boxed{20}", stop=False),
                             turn("\\boxed{37}")])
    result = play(engine, GuessNumberEnv(37, 100, 5, "go"))
    text = TOKENIZER.decode(result.response_ids)
    assert text.count("<|im_end|>\n<|im_start|>user") == 2
    assert "<|im_end|><|im_end|>" not in text
    assert text.endswith("\\boxed{37}<|im_end|>")
    assert text.count("<|im_end|>") == 5  # 3 turns closed, 2 observations closed


def test_every_policy_token_keeps_its_version_across_weight_syncs():
    version = Version(3)
    t1_len = len(turn("\\boxed{20}", chunk=100)[0].token_ids)
    t2_len = len(turn("\\boxed{37}", chunk=100)[0].token_ids)
    engine = ScriptedEngine(
        [turn("\\boxed{10}"),  # unlabelled: the version loaded when the tokens arrive (3)
         turn("\\boxed{20}", chunk=100, segments=[[(4, t1_len)]]),
         # a sync in the middle of the turn, labelled by the engine
         turn("\\boxed{37}", chunk=100, segments=[[(4, 1), (5, t2_len - 1)]])],
        before_turn={1: lambda: setattr(version, "value", 4),
                     2: lambda: setattr(version, "value", 5)})
    result = play(engine, GuessNumberEnv(37, 100, 5, "go"), version=version)
    t = trajectory(result)
    runs_ = runs(result.loss_mask)
    t0, obs0, t1, obs1, _ = (n for _, n in runs_)
    # Observation 0 came while version 3 was loaded, observation 1 under 4.
    assert t.segments == [Segment(3, t0 + obs0), Segment(4, t1 + obs1 + 1),
                          Segment(5, t2_len - 1)]
    assert (t.oldest_version, t.newest_version) == (3, 5)


def test_max_turns_cuts_the_episode_and_drops_the_last_observation():
    env = Endless()
    engine = ScriptedEngine([turn(f"turn {k}") for k in range(10)])
    result = play(engine, env, EpisodeLimits(max_turns=3))
    trajectory(result)
    assert (result.num_turns, result.finish_reason, len(engine.requests)) == (3, "length", 3)
    assert result.reward == pytest.approx(1.5) and env.actions == ["turn 0", "turn 1", "turn 2"]
    assert [m for m, _ in runs(result.loss_mask)] == [1, 0, 1, 0, 1]


def test_the_episode_token_budget_bounds_every_turn():
    budget = 40
    engine = ScriptedEngine([turn("I will say quite a lot this turn, " * 3) for _ in range(10)])
    sampling = SamplingSpec(max_tokens=16, min_tokens=12)
    result = play(engine, Endless(), EpisodeLimits(max_turns=10, max_episode_tokens=budget),
                  sampling=sampling)
    trajectory(result)
    assert result.finish_reason == "length"
    assert len(result.response_ids) <= budget and result.loss_mask[-1] == 1
    used = 0
    for _, prompt_ids, turn_sampling in engine.requests:
        used = len(prompt_ids) - len(result.prompt_ids)
        assert turn_sampling.max_tokens == min(16, budget - used)
        assert turn_sampling.min_tokens == min(12, turn_sampling.max_tokens)
        assert (turn_sampling.temperature, turn_sampling.seed) == (1.0, None)
    assert len(engine.requests) >= 2 and used > 0


def test_an_observation_that_does_not_fit_the_budget_ends_the_episode():
    engine = ScriptedEngine([turn("hi") for _ in range(3)])
    policy = len(TOKENIZER.encode("hi", add_special_tokens=False)) + 1
    result = play(engine, Endless(), EpisodeLimits(max_episode_tokens=policy + 3))
    assert (result.num_turns, result.finish_reason) == (1, "length")
    assert result.loss_mask == [1] * policy


def test_a_slow_step_ends_the_episode_with_env_timeout_and_no_reward():
    class SlowSecond(Endless):
        def step(self, action):
            self.step_s = 0.4 if self.actions else 0.0
            return super().step(action)

    engine = ScriptedEngine([turn("a"), turn("b"), turn("c")])
    result = play(engine, SlowSecond(), EpisodeLimits(turn_timeout_s=0.05))
    trajectory(result)
    assert (result.reward_error, result.reward, result.num_turns) == ("env_timeout", 0.0, 2)
    assert result.finish_reason == "stop"
    assert [m for m, _ in runs(result.loss_mask)] == [1, 0, 1]


def test_the_episode_timeout_is_a_budget():
    env = Endless(step_s=0.05)
    engine = ScriptedEngine([turn("go on") for _ in range(50)])
    result = play(engine, env, EpisodeLimits(max_turns=50, turn_timeout_s=5.0,
                                             episode_timeout_s=0.12))
    trajectory(result)
    assert (result.finish_reason, result.reward_error) == ("length", "")
    assert 1 <= result.num_turns < 50 and result.loss_mask[-1] == 1
    assert result.env_seconds > 0


def test_an_environment_that_raises_marks_the_episode(caplog):
    class Broken(Endless):
        def step(self, action):
            if self.actions:
                raise RuntimeError("the simulator fell over")
            return super().step(action)

    engine = ScriptedEngine([turn("a"), turn("b"), turn("c")])
    with caplog.at_level(logging.ERROR, logger="reflow.rollout.episode"):
        result = play(engine, Broken())
    trajectory(result)
    assert (result.reward_error, result.reward, result.finish_reason) == ("env_exception", 0.0,
                                                                          "stop")
    assert result.num_turns == 2 and result.loss_mask[-1] == 1
    assert "the simulator fell over" in caplog.text and "ep" in caplog.text


@pytest.mark.parametrize("reward, error", [(float("nan"), "non_finite"),
                                           (float("inf"), "non_finite"),
                                           ("lots", "env_exception")])
def test_a_reward_that_is_not_a_finite_number_scores_zero(reward, error):
    class Odd(Endless):
        def step(self, action):
            return StepResult(observation="", reward=reward, done=True)

    result = play(ScriptedEngine([turn("a")]), Odd())
    assert (result.reward_error, result.reward, result.num_turns) == (error, 0.0, 1)


def test_a_step_that_returns_something_else_is_an_env_exception():
    class Wrong(Endless):
        def step(self, action):
            return {"observation": "x"}

    result = play(ScriptedEngine([turn("a")]), Wrong())
    assert (result.reward_error, result.reward) == ("env_exception", 0.0)


def test_an_aborted_generation_ends_the_episode():
    engine = ScriptedEngine([turn("a"), turn("half", stop=False, finish_reason="abort")])
    env = Endless()
    result = play(engine, env)
    trajectory(result)
    assert (result.finish_reason, result.num_turns, len(env.actions)) == ("abort", 2, 1)
    assert result.reward == 0.5


def test_a_reset_that_fails_gives_an_empty_episode():
    class NoStart(Endless):
        def reset(self):
            raise OSError("no simulator")

    engine = ScriptedEngine([turn("a")])
    result = play(engine, NoStart())
    assert (result.prompt_ids, result.response_ids, result.reward_error) == ([], [],
                                                                           "env_exception")
    assert result.finish_reason == "abort" and engine.requests == []


def test_a_calculator_episode_calls_the_tool_then_answers():
    task = CalculatorTask()
    env = CalculatorEnv("What is 12 * 34?", 408)
    call = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "12 * 34"}}\n</tool_call>'
    engine = ScriptedEngine([turn(call), turn("The answer is \\boxed{408}.")])
    result = play(engine, env, task.limits, system_prompt=task.system_prompt, tools=task.tools)
    trajectory(result)
    assert (result.reward, result.num_turns, result.tool_calls) == (1.0, 2, 1)
    assert result.tool_seconds >= 0.0 and result.finish_reason == "stop"
    assert '"name": "calculator"' in TOKENIZER.decode(result.prompt_ids)
    observation = TOKENIZER.decode([i for i, m in zip(result.response_ids, result.loss_mask)
                                    if not m])
    assert observation == ("\n<|im_start|>user\n<tool_response>\n408\n</tool_response><|im_end|>\n"
                           "<|im_start|>assistant\n")


def test_episode_limits_refuse_nonsense():
    with pytest.raises(ValueError):
        EpisodeLimits(max_turns=0)
    with pytest.raises(ValueError):
        EpisodeLimits(turn_timeout_s=0)
