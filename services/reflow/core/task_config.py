"""The task's section of the job spec: which registered task, its own arguments,
and how its rewards run (reflow.tasks, reflow.tasks.rewards)."""

from __future__ import annotations

from pydantic import Field, model_validator

from reflow.core import plugins
from reflow.core.sections import PluginArgs, _Section


class TaskConfig(_Section):
    """The environment: prompts and the reward function."""

    name: str = Field(
        default="repeat", min_length=1, max_length=128,
        description="A registered task: the built-ins repeat, math, reasoning_gym, "
        "guess_number (multi-turn), calculator (multi-turn, tool calls), or an entry point "
        "in group reflow.tasks that the operator installed.",
    )
    args: PluginArgs = Field(
        default_factory=dict,
        description="The task's own arguments, checked against its Args model (e.g. "
        "repeat: max_count, num_symbols; math: path, prompt_column, answer_column).",
    )
    reward_timeout_s: float = Field(
        default=10.0, gt=0.0, le=600.0,
        description="Longest a reward may take; past it the sample is marked "
        "reward_error=timeout and its scoring process replaced.",
    )
    reward_workers: int = Field(
        default=1, ge=1, le=64,
        description="Reward processes per rollout worker (rewards run off the worker's event "
        "loop, each call in a process's main thread).",
    )
    max_reward_error_rate: float = Field(
        default=0.1, ge=0.0, le=1.0,
        description="The job fails when more than this share of a rollout worker's last "
        "`reward_error_window` scored samples had no reward (an exception, a timeout, a "
        "non-finite value); below it such samples are excluded from the loss and counted.",
    )
    reward_error_window: int = Field(
        default=200, ge=1, le=1_000_000,
        description="Samples the reward error rate is measured over (and the fewest scored "
        "before it can fail a job).",
    )

    @model_validator(mode="after")
    def _check_task(self) -> TaskConfig:
        # By registered name only, arguments against the task's own model: a typo
        # fails at submission. Files a task reads are checked by the scheduler
        # (reflow.tasks.check_task), which has the datasets root.
        plugins.validate_args("task", self.name, self.args, "task.name", "task.args")
        return self


class EvalConfig(_Section):
    """Periodic evaluation on the task's held-out split (rollout/evaluation.py): on
    a rollout worker beside training, so training does not wait for it."""

    interval: int = Field(
        default=0, ge=0, le=1_000_000,
        description="Evaluate every this many policy versions (and the initial weights "
        "first); 0: never.",
    )
    num_prompts: int = Field(
        default=32, ge=1, le=4096,
        description="Held-out prompts per evaluation, one sample each.",
    )
    greedy: bool = Field(
        default=True,
        description="Greedy decoding; false: the job's sampling temperature.",
    )
