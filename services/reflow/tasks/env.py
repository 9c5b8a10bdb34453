"""The base of multi-turn tasks: a task whose prompt opens an episode that an
environment answers turn by turn (paper §4.1 step 2, multi-turn).

An `EnvTask` owns what a single-turn task owns (a seeded stream of prompts and
a fixed held-out split) plus the episode's environment, its chat scaffolding
(a system prompt, tool schemas) and its limits. Every prompt describes one
episode completely: its `answer` holds the episode's seed (JSON), so every
member of a GRPO group, and every service that rebuilds the task, sees the same
first observation and the same environment behaviour.

It knows nothing of engines, tokenizers or token budgets being spent: the
rollout worker's episode loop (reflow.rollout.episode) drives the environment
and enforces `limits`.
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, Field

from reflow.tasks.answers import last_boxed, last_number
from reflow.tasks.base import Environment, EpisodeLimits, Prompt, TaskContext

# Training episodes get even seeds, held-out ones odd seeds: the two splits can
# never share an episode, whatever the job's seed.
EVAL_STREAM_SEED = 20_240_917
MAX_SEED_BITS = 48


class EnvTask:
    """A multi-turn task. Subclasses give `episode_prompt` and `environment`,
    and may extend `Args` (as `class Args(EnvTask.Args)`) with their own fields."""

    multi_turn: ClassVar[bool] = True
    # A system message for every episode (None: the chat template's default).
    system_prompt: str | None = None
    # JSON schemas of the tools the policy may call, passed to the chat template
    # (`apply_chat_template(..., tools=...)`); None: no tools.
    tools: list[dict[str, Any]] | None = None

    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

        max_turns: int = Field(default=6, ge=1, le=64,
                               description="Policy turns an episode may take before it is cut "
                               "(finish reason `length`).")
        max_episode_tokens: int = Field(default=4096, ge=16, le=262_144,
                                        description="Tokens after the first prompt that an "
                                        "episode may hold: every turn's policy tokens and the "
                                        "observations between them.")
        turn_timeout_s: float = Field(default=10.0, gt=0.0, le=600.0,
                                      description="Seconds one environment step (or reset) may "
                                      "take; a slower one ends the episode with reward 0 "
                                      "(`env_timeout`).")
        episode_timeout_s: float = Field(default=600.0, gt=0.0, le=7200.0,
                                         description="Wall-clock seconds an episode may run; "
                                         "checked between turns, and it bounds each step.")

    def __init__(self, context: TaskContext | None = None, **args: Any) -> None:
        # Validated here too, so a task built directly (tests, scripts) gets the
        # same defaults and bounds as one built from a job spec.
        self.args = self.Args(**args)
        self.context = context or TaskContext()

    @property
    def limits(self) -> EpisodeLimits:
        return EpisodeLimits(max_turns=self.args.max_turns,
                             max_episode_tokens=self.args.max_episode_tokens,
                             turn_timeout_s=self.args.turn_timeout_s,
                             episode_timeout_s=self.args.episode_timeout_s)

    def episode_prompt(self, prompt_id: str, episode_seed: int) -> Prompt:
        """The prompt of the episode `episode_seed` names: its first user message
        as `text`, and in `answer` what `environment` needs to rebuild it
        (use `episode_answer`)."""
        raise NotImplementedError

    def environment(self, prompt: Prompt) -> Environment:
        """A fresh environment for one episode of `prompt`; the same prompt always
        gives an environment that behaves the same."""
        raise NotImplementedError

    def prompts(self) -> Iterator[Prompt]:
        """An endless stream of training episodes, seeded by the job's seed."""
        rng = random.Random(self.context.seed)  # nosec B311 # seeded episodes, not security
        i = 0
        while True:
            yield self.episode_prompt(f"p{i}", 2 * rng.getrandbits(MAX_SEED_BITS))
            i += 1

    def eval_prompts(self, num_prompts: int) -> list[Prompt]:
        """The first `num_prompts` held-out episodes: the same for every job, so
        evaluations of different runs compare."""
        rng = random.Random(EVAL_STREAM_SEED)  # nosec B311 # seeded episodes, not security
        return [self.episode_prompt(f"e{i}", 2 * rng.getrandbits(MAX_SEED_BITS) + 1)
                for i in range(num_prompts)]


def episode_answer(episode_seed: int, **facts: Any) -> str:
    """A prompt's `answer`: the episode seed, plus facts worth reading in logs
    (the secret, the exact result). Environments rebuild from the seed alone."""
    return json.dumps({"seed": episode_seed, **facts}, sort_keys=True)


def episode_seed(prompt: Prompt) -> int:
    """The seed `episode_answer` put in a prompt; ValueError for any other prompt."""
    try:
        seed = json.loads(prompt.answer)["seed"]
    except (ValueError, TypeError, KeyError):
        raise ValueError(f"prompt {prompt.prompt_id}: answer {prompt.answer[:80]!r} does not "
                         "name an episode seed") from None
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise ValueError(f"prompt {prompt.prompt_id}: episode seed {seed!r} is not an integer")
    return seed


def final_text(text: str) -> str:
    """What a turn says after its reasoning: the text after the last `</think>`
    (a reasoning model's scratch work must not be read as its answer)."""
    _, sep, tail = text.rpartition("</think>")
    return tail if sep else text


def answer_number(text: str) -> str | None:
    """The number a turn answers with, as text: the last number inside the last
    `\\boxed{}` if there is a box, else the last number written (thousands
    commas dropped); None if there is none."""
    text = final_text(text)
    boxed = last_boxed(text)
    return last_number(boxed if boxed is not None else text)
