"""The task's section of the job spec: which registered task, its own arguments,
and how its rewards run (reflow.tasks, reflow.tasks.rewards)."""

from __future__ import annotations

from pydantic import Field, model_validator

from reflow.core import plugins
from reflow.core.sections import PluginArgs, _Section


MiB, GiB = 1 << 20, 1 << 30
# Samples per held-out prompt, and per evaluation (prompts x k): an evaluation
# generates beside training and must end well within its deadline.
MAX_EVAL_K = 256
MAX_EVAL_SAMPLES = 65_536


class RewardLimits(_Section):
    """Resource limits of one reward process (reflow.tasks.confine), set by the
    child itself before it imports the task: what a hostile or runaway reward
    can take from the rollout worker's machine."""

    memory_bytes: int = Field(
        default=4 * GiB, ge=256 * MiB, le=1 << 40,
        description="Address space of a reward process (RLIMIT_AS); an allocation past it "
        "raises MemoryError and the call fails with reward_error=resource_limit. Raise it "
        "for a reward that loads a model.")
    file_bytes: int = Field(
        default=64 * MiB, ge=0, le=1 << 40,
        description="Largest file a reward process may write (RLIMIT_FSIZE).")
    max_processes: int = Field(
        default=16, ge=1, le=4096,
        description="Processes and threads a reward process may start (RLIMIT_NPROC, "
        "counted per user namespace; see reflow.tasks.confine).")
    cpu_s_per_call: int = Field(
        default=0, ge=0, le=86_400,
        description="CPU seconds one reward call may use, all its threads together (the "
        "soft RLIMIT_CPU, re-armed before each call); 0: twice the call timeout.")
    cpu_s_lifetime: int = Field(
        default=6 * 3600, ge=1, le=30 * 86_400,
        description="CPU seconds a reward process may use over its life (the hard "
        "RLIMIT_CPU); it is replaced before it reaches them.")


class TaskConfig(_Section):
    """The environment: prompts and the reward function."""

    name: str = Field(
        default="repeat", min_length=1, max_length=128,
        description="A registered task: the built-ins repeat, math, reasoning_gym, "
        "guess_number (multi-turn), calculator (multi-turn, tool calls), python_tool "
        "(multi-turn, code run in the sandbox), code_tests (programs scored by unit tests in "
        "the sandbox), coding_agent (multi-turn: revise against visible tests, scored by "
        "hidden ones), agent (an agent program through the worker's OpenAI-compatible "
        "endpoint), or an entry point in group reflow.tasks that the operator installed.",
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
        "non-finite value, a resource limit, a malformed reply); below it such samples are excluded from the loss and counted.",
    )
    reward_limits: RewardLimits = Field(
        default_factory=RewardLimits,
        description="Resource limits of each reward process (address space, file size, "
        "processes, CPU seconds); past one the call fails with reward_error=resource_limit.",
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
    a rollout worker beside training, so training does not wait for it. Each
    held-out prompt gets `k` samples; the record reports pass@1, pass@k, avg@k
    and, for a task that gives final answers, maj@k (rollout/eval_metrics.py)."""

    interval: int = Field(
        default=0, ge=0, le=1_000_000,
        description="Evaluate every this many policy versions (and the initial weights "
        "first); 0: never.",
    )
    num_prompts: int = Field(
        default=32, ge=1, le=4096,
        description="Held-out prompts per evaluation, `k` samples each.",
    )
    k: int = Field(
        default=1, ge=1, le=MAX_EVAL_K,
        description="Samples per held-out prompt (n of the pass@k estimator): pass@1, "
        "pass@k, avg@k and maj@k are computed from them. Above 1 they are sampled "
        "(distinct seeds); multi-turn tasks play k episodes per prompt.",
    )
    pass_k: list[int] = Field(
        default_factory=list, max_length=8,
        description="Further k' (1 to k) whose pass@k' is reported from the same k samples, "
        "besides pass@1 and pass@k: [2, 4] adds eval_pass_at_2 and eval_pass_at_4.",
    )
    greedy: bool | None = Field(
        default=None,
        description="Greedy decoding (temperature 0); false: sampled at `temperature`. "
        "Unset: greedy when k is 1 and no temperature is set, sampled otherwise.",
    )
    temperature: float | None = Field(
        default=None, gt=0.0, le=4.0,
        description="Temperature of sampled evaluations; unset: the job's "
        "rollout.temperature (with its top_p and top_k either way).",
    )
    correct_threshold: float = Field(
        default=1.0, ge=-1e6, le=1e6,
        description="A sample is correct (pass@k, maj@k) when its reward is at least this: "
        "1.0 fits tasks that score 1 for a right answer (math, reasoning-gym's exact "
        "answers, repeat); lower it for a task with partial credit.",
    )

    @property
    def sampled(self) -> bool:
        """Whether evaluation samples (at `temperature`) rather than decodes greedily."""
        if self.greedy is not None:
            return not self.greedy
        return self.k > 1 or self.temperature is not None

    @model_validator(mode="after")
    def _check_sampling(self) -> EvalConfig:
        if self.greedy and self.k > 1:
            raise ValueError("eval.greedy: k > 1 needs sampling (greedy decoding gives k "
                             "identical samples); set eval.greedy=false or leave it unset")
        if self.greedy and self.temperature is not None:
            raise ValueError("eval.temperature: greedy decoding takes no temperature; set "
                             "eval.greedy=false or unset eval.temperature")
        for j in self.pass_k:
            if not 1 <= j <= self.k:
                raise ValueError(f"eval.pass_k: {j} is not in 1 to eval.k ({self.k}): pass@k' "
                                 "needs at least k' samples per prompt")
        if self.num_prompts * self.k > MAX_EVAL_SAMPLES:
            raise ValueError(f"eval.k: {self.num_prompts} prompts x {self.k} samples is over "
                             f"{MAX_EVAL_SAMPLES} samples per evaluation; lower eval.k or "
                             "eval.num_prompts")
        return self
