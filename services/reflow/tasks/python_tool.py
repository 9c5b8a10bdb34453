"""The built-in multi-turn task `python_tool` (ReTool-style): math problems the
policy may work on by running Python. Each turn may hold one ```python block;
the environment runs it in the sandbox and answers with what it printed (a
`tool` message, masked out of the loss). A turn without a code block is the
final answer (`\\boxed{}`, or the configured fallback), scored 1 or 0; an
episode that reaches `max_turns` first scores 0.

The problems are the `math` task's: the same dataset arguments (a JSONL or
Parquet file under the datasets root, e.g. what `reflow datasets export-gym`
writes), read and split by reflow.tasks.math itself.

Scoring runs in the environment's thread, where math-verify's `signal.alarm`
cannot bound it, and a hostile answer (`9^{9^{9}}`) would hold sympy for
hours. So a plain number against a plain-number reference is compared
exactly here (no sympy: the common case, arithmetic), and anything else is
checked by math-verify in the sandbox, a program of ours given the answer as
data on its stdin, under the sandbox's limits: exit status 0 is a match.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterator
from fractions import Fraction

from pydantic import Field, model_validator

from reflow.sandbox.client import default_client
from reflow.sandbox.types import OK, ExecLimits, ExecRequest
from reflow.tasks.answers import extract_answer
from reflow.tasks.base import Prompt, StepResult
from reflow.tasks.code import SandboxArgs, execution_text, extract_code
from reflow.tasks.env import EnvTask, episode_answer, final_text
from reflow.tasks.math import MathTask, _as_math

SYSTEM_PROMPT = ("Solve the problem. You may run Python: write one ```python code block in a "
                 "turn and you will be shown what it prints (use print). When you know the "
                 "answer, reply without a code block and give the final answer as \\boxed{}.")
MAX_ANSWER_CHARS = 200
_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:/\d+)?")
# math-verify in the sandbox: our program, the answer as data. It imports sympy
# (a second or two), so its limits are its own, not the policy's code's.
VERIFY = r'''
import json, sys
from math_verify import parse, verify
gold, guess = json.loads(sys.stdin.read())
gold, guess = parse(gold), parse(guess)
sys.exit(0 if gold and guess and verify(gold, guess) else 3)
'''
VERIFY_LIMITS = ExecLimits(wall_s=15.0, cpu_s=15.0, memory_bytes=2 * 2**30, max_processes=8,
                           max_output_bytes=64 * 1024)


def plain_number(text: str) -> Fraction | None:
    """`text` as an exact number when it is only one (`-1,234.50`, `3/4`, `$12$`)."""
    text = text.strip().strip("$").strip().replace(",", "")
    if len(text) > 64 or not _PLAIN_NUMBER.fullmatch(text):
        return None
    try:
        return Fraction(text)
    except (ValueError, ZeroDivisionError):
        return None


def same_answer(answer: str, reference: str, job_id: str = "") -> bool:
    """Whether a final answer equals the reference: exactly for plain numbers,
    else math-verify in the sandbox. A sandbox without math-verify raises."""
    if len(answer) > MAX_ANSWER_CHARS:
        return False
    found, expected = plain_number(answer), plain_number(reference)
    if found is not None and expected is not None:
        return found == expected
    result = default_client().execute(ExecRequest(
        code=VERIFY, stdin=json.dumps([_as_math(reference), _as_math(answer)]),
        limits=VERIFY_LIMITS), job_id)
    if result.status != OK and "No module named 'math_verify'" in result.stderr:
        raise RuntimeError("python_tool: the sandbox's Python has no math-verify; "
                           "non-numeric answers cannot be scored")
    return result.status == OK


class PythonToolEnv:
    """One problem; each turn runs its code block or answers."""

    def __init__(self, task: PythonToolTask, question: str, reference: str) -> None:
        self.task, self.question, self.reference = task, question, reference

    def reset(self) -> str:
        return self.question

    def step(self, action: str) -> StepResult:
        text = final_text(action)
        block = extract_code(text)
        if block is None:
            answer = extract_answer(text, self.task.args.answer_fallback)
            correct = answer is not None and same_answer(answer, self.reference,
                                                         self.task.job_id)
            return StepResult(observation="Correct." if correct else "Incorrect.",
                              reward=float(correct), done=True,
                              info={"answer": (answer or "")[:MAX_ANSWER_CHARS],
                                    "correct": correct})
        if block.error:
            return StepResult(observation=f"error: {block.error}", role="tool")
        started = time.perf_counter()
        result = default_client().execute(ExecRequest(code=block.code,
                                                      limits=self.task.args.exec_limits),
                                          self.task.job_id)
        return StepResult(observation=execution_text(result, self.task.args.max_output_chars),
                          role="tool", tool_calls=1,
                          tool_seconds=time.perf_counter() - started,
                          info={"status": result.status})


class PythonToolTask(EnvTask):
    needs_sandbox = True

    class Args(EnvTask.Args, SandboxArgs, MathTask.Args):
        max_turns: int = Field(default=4, ge=1, le=64,
                               description="Turns an episode may take: code runs and the "
                               "final answer.")
        turn_timeout_s: float = Field(default=30.0, gt=0.0, le=600.0,
                                      description="Seconds one environment step may take: a "
                                      "sandbox run plus its wait for a slot.")
        max_output_chars: int = Field(default=1000, ge=100, le=20_000,
                                      description="Characters of a run's output the policy "
                                      "is shown (stdout's head, stderr's tail).")

        @model_validator(mode="after")
        def _step_outlasts_run(self):
            slowest = max(self.exec_wall_s, VERIFY_LIMITS.wall_s)
            if self.turn_timeout_s <= slowest:
                raise ValueError(f"turn_timeout_s ({self.turn_timeout_s}) must exceed "
                                 f"{slowest}s: exec_wall_s, and the answer check's limit")
            return self

    args: Args

    def __init__(self, context=None, **args) -> None:
        super().__init__(context, **args)
        self.math = MathTask(**self._math_args(self.args), context=self.context)

    @staticmethod
    def _math_args(args) -> dict:
        return {name: getattr(args, name) for name in MathTask.Args.model_fields}

    @classmethod
    def check(cls, args, context) -> None:
        """At submission: the math task's own check of its files."""
        MathTask.check(MathTask.Args(**cls._math_args(args)), context)

    @property
    def system_prompt(self) -> str:  # type: ignore[override]
        return self.args.system_prompt or SYSTEM_PROMPT

    @property
    def job_id(self) -> str:
        return str(getattr(self.context, "job_id", "") or "")

    @staticmethod
    def _episode(prompt: Prompt, number: int) -> Prompt:
        # The reference rides in the prompt's answer, beside the episode's number.
        return Prompt(prompt_id=prompt.prompt_id, text=prompt.text,
                      answer=episode_answer(number, reference=prompt.answer))

    def prompts(self) -> Iterator[Prompt]:
        for number, prompt in enumerate(self.math.prompts()):
            yield self._episode(prompt, number)

    def eval_prompts(self, num_prompts: int) -> list[Prompt]:
        return [self._episode(p, i) for i, p in enumerate(self.math.eval_prompts(num_prompts))]

    def environment(self, prompt: Prompt) -> PythonToolEnv:
        try:
            reference = json.loads(prompt.answer)["reference"]
        except (ValueError, TypeError, KeyError):
            reference = None
        if not isinstance(reference, str):
            raise ValueError(f"prompt {prompt.prompt_id}: its answer holds no reference")
        return PythonToolEnv(self, prompt.text, reference)
