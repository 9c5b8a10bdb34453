"""Tasks: where prompts come from and how responses are scored (paper §4.1
steps 1-2), resolved by registered name like samplers and filters
(reflow.core.plugins): the built-ins `repeat`, `math`, `reasoning_gym`,
`guess_number`, `calculator`, the sandboxed-code tasks `python_tool`,
`code_tests` and `coding_agent` (reflow.sandbox runs their programs) and
`agent` (an agent program as the environment), plus entry points in group
`reflow.tasks` that the operator installs. A job spec names a task and gives its `task.args`,
validated against the task's own `Args` model; it never names code.

A task is built with its arguments and a `TaskContext` (the job's task seed and
the datasets root). The dispatcher (scheduler) draws prompts from it; the
rollout worker renders them (the model's chat template for a task with
`prompt_messages`), generates, and scores through a reward pool
(reflow.tasks.rewards) or, for a multi-turn task (`multi_turn = True`), runs
the episode loop against its environment (reflow.rollout.episode).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reflow.core import plugins
from reflow.tasks.base import ChatTask, Environment, Prompt, StepResult, Task, TaskContext

__all__ = ["ChatTask", "Environment", "Prompt", "StepResult", "Task", "TaskContext",
           "build_task", "build_task_by_name", "check_task", "is_multi_turn", "task_context"]


def _resolve(name: str) -> type:
    cls = plugins.resolve("task", name, "task.name")
    if not (callable(getattr(cls, "reward", None)) or callable(getattr(cls, "environment", None))):
        raise ValueError(f"task.name: plug-in {name!r} has neither `reward` nor `environment`")
    return cls


def task_context(spec, datasets_root: str | Path | None = None, job_id: str = "") -> TaskContext:
    """The context every service builds the job's task with: the same seed
    everywhere (a dataset's split and order depend on it), this service's
    datasets root, and the job's id where the service knows it."""
    from reflow.core.paths import datasets_root as default_root

    return TaskContext(seed=spec.seed + 1,
                       datasets_root=Path(datasets_root or default_root()), job_id=job_id)


def build_task_by_name(name: str, args: dict[str, Any] | None, context: TaskContext) -> Any:
    _resolve(name)
    return plugins.build("task", name, args, field="task.name", args_field="task.args",
                         context=context)


def build_task(spec, datasets_root: str | Path | None = None, job_id: str = "") -> Any:
    """The job's task, from `spec.task`."""
    return build_task_by_name(spec.task.name, spec.task.args,
                              task_context(spec, datasets_root, job_id))


def check_task(spec, datasets_root: str | Path | None = None) -> None:
    """At submission: the task's own check of what it reads (a dataset file under
    the root, its columns), where it has one. ValueError names the field."""
    cls = _resolve(spec.task.name)
    check = getattr(cls, "check", None)
    if check is not None:
        args = plugins.validate_args("task", spec.task.name, spec.task.args, "task.name",
                                     "task.args")
        check(args, task_context(spec, datasets_root))


def is_multi_turn(task: Any) -> bool:
    return bool(getattr(task, "multi_turn", False))
