"""What a task is: a dataset side (a seeded stream of training prompts and a
fixed held-out split) and a reward side (a score for a decoded response), and,
for a multi-turn task, an environment the rollout worker steps through an
episode.

A task knows nothing of engines, buffers, tokenizers or training steps. A task
that talks to an instruct model says so by giving `prompt_messages`: the rollout
worker then renders them with the model's own chat template; without it the
prompt text is encoded as it is (the `repeat` task on its tiny tokenizer).

Rewards do not run here: the rollout worker hands them to a process pool
(reflow.tasks.rewards) with a timeout, so a slow, raising or non-finite reward
marks the sample (`reward_error`) and never reaches the worker's event loop.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    # Task-specific ground truth the reward function needs (a string, so it
    # crosses gRPC as it is; a task may encode more in it, e.g. JSON).
    answer: str


@dataclass(frozen=True)
class TaskContext:
    """What the service hands every task it builds, besides the spec's `task.args`:
    the seed of its prompt stream and the operator's datasets root (datasets a
    spec names must lie below it; reflow.core.paths)."""

    seed: int = 0
    datasets_root: Path = Path(".reflow/datasets")
    # The job the task is built for, where a service knows it (the rollout worker):
    # calls a task makes to other services (the sandbox) name it, with the job's pass.
    job_id: str = ""


class Task(Protocol):
    """A single-turn task. Built as `cls(**args, context=TaskContext)`."""

    def prompts(self) -> Iterator[Prompt]:
        """An endless, seeded stream of training prompts."""
        ...

    def eval_prompts(self, num_prompts: int) -> list[Prompt]:
        """The first `num_prompts` prompts of the held-out split, the same every call."""
        ...

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """Score a decoded response, usually 0 (wrong) to 1 (correct). Runs in a
        reward pool process, in its main thread (math-verify's signal.alarm)."""
        ...


@runtime_checkable
class ChatTask(Protocol):
    """A task whose prompts are chat messages, rendered with the model's template."""

    def prompt_messages(self, prompt: Prompt) -> list[dict[str, Any]]: ...


@runtime_checkable
class AnswerTask(Protocol):
    """A task whose responses end in a final answer (math, reasoning-gym, repeat):
    evaluation votes on the answers of a prompt's k samples (maj@k,
    reflow.rollout.eval_metrics). A task without the method gets no maj@k."""

    def final_answer(self, prompt: Prompt, response_text: str) -> str | None:
        """The response's final answer in a canonical form (two answers the task
        would score alike should compare equal as strings), or None if it gives
        none (it casts no vote). Runs in the rollout worker: cheap, no I/O."""
        ...


@dataclass
class StepResult:
    """What an environment answers to one action (paper §4.1 step 2, multi-turn)."""

    observation: str
    reward: float = 0.0
    done: bool = False
    # Chat role the observation is rendered under: "user" (environment text) or
    # "tool" (a tool's result).
    role: str = "user"
    # Tool calls this step made and the seconds they took, for the metrics.
    tool_calls: int = 0
    tool_seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


class Environment(Protocol):
    """One episode's state. `reset` gives the first observation (the first user
    message); each `step` takes the policy's decoded turn."""

    def reset(self) -> str: ...

    def step(self, action: str) -> StepResult: ...


@dataclass(frozen=True)
class EpisodeLimits:
    """Bounds of one episode (the task's `Args` fill them, reflow.tasks.env; the rollout
    worker's episode loop keeps to them, reflow.rollout.episode)."""

    max_turns: int = 6
    # Tokens after the first prompt: policy tokens and observation tokens.
    max_episode_tokens: int = 4096
    # One environment step (or reset) in its thread.
    turn_timeout_s: float = 10.0
    # The whole episode, wall clock; checked before each turn and bounding each step.
    episode_timeout_s: float = 600.0

    def __post_init__(self) -> None:
        if self.max_turns < 1 or self.max_episode_tokens < 1:
            raise ValueError(f"episode limits: max_turns ({self.max_turns}) and "
                             f"max_episode_tokens ({self.max_episode_tokens}) must be >= 1")
        if not (self.turn_timeout_s > 0 and self.episode_timeout_s > 0):
            raise ValueError(f"episode limits: turn_timeout_s ({self.turn_timeout_s}) and "
                             f"episode_timeout_s ({self.episode_timeout_s}) must be > 0")
