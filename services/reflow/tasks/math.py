"""The built-in task `math`: problems from a local dataset file, posed to an
instruct model through its own chat template, the final answer extracted
(`\\boxed{}`, or a configured fallback) and checked against the reference with
math-verify, as DAPO-Math and DeepScaleR score.

The dataset (JSON Lines or Parquet) lies under the operator's datasets root;
its rows are read lazily, the first time prompts are asked for, so a reward
pool process that only scores never reads the file. math-verify bounds its
parsing with `signal.alarm`, which works only in a main thread: the reward
pool (reflow.tasks.rewards) calls `reward` in its processes' main threads.
math-verify itself (sympy, its LaTeX grammar: a second or more on a busy
machine) is imported where the task is built, before the pool reports ready,
so no reward call's timeout pays for it.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from reflow.tasks.answers import Fallback, canonical_answer, extract_answer
from reflow.tasks.base import Prompt, TaskContext
from reflow.tasks.datasets import Row, read_rows, split_rows

DEFAULT_INSTRUCTION = "Put your final answer within \\boxed{}."


class MathTask:
    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

        path: str = Field(min_length=1, max_length=4096,
                          description="Dataset file (.jsonl or .parquet) under the datasets "
                          "root (REFLOW_DATASETS_DIR); a relative path is taken under it.")
        prompt_column: str = Field(default="question", min_length=1, max_length=128,
                                   description="Column holding the problem text.")
        answer_column: str = Field(default="answer", min_length=1, max_length=128,
                                   description="Column holding the reference answer.")
        eval_path: str = Field(default="", max_length=4096,
                               description="A separate held-out file (same columns); empty: "
                               "hold out `eval_fraction` of `path`.")
        eval_fraction: float = Field(default=0.05, ge=0.0, lt=1.0,
                                     description="Share of `path` held out for evaluation when "
                                     "no eval_path is given.")
        instruction: str = Field(default=DEFAULT_INSTRUCTION, max_length=1024,
                                 description="Appended to every problem (a blank line between).")
        system_prompt: str = Field(default="", max_length=4096,
                                   description="A system message; empty: the template's default.")
        answer_fallback: Fallback = Field(
            default="last_number",
            description="Where the answer is taken from when the response has no \\boxed{}: "
            "`last_number` (the last number written) or `none` (scored wrong).")

    def __init__(self, path: str, prompt_column: str = "question", answer_column: str = "answer",
                 eval_path: str = "", eval_fraction: float = 0.05,
                 instruction: str = DEFAULT_INSTRUCTION, system_prompt: str = "",
                 answer_fallback: Fallback = "last_number",
                 context: TaskContext | None = None) -> None:
        context = context or TaskContext()
        self.root = Path(context.datasets_root)
        self.seed = context.seed
        self.path, self.eval_path = path, eval_path
        self.columns = (prompt_column, answer_column)
        self.eval_fraction = eval_fraction
        self.instruction, self.system_prompt = instruction, system_prompt
        self.answer_fallback = answer_fallback
        self._splits: tuple[list[Row], list[Row]] | None = None
        _load_math_verify()

    @classmethod
    def check(cls, args: Args, context: TaskContext) -> None:
        """At submission: the files lie under the datasets root and have the columns."""
        cls(**dict(args), context=context)._load()

    def _load(self) -> tuple[list[Row], list[Row]]:
        if self._splits is None:
            rows = read_rows(self.path, self.root, *self.columns)
            if self.eval_path:
                held_out = read_rows(self.eval_path, self.root, *self.columns)
                self._splits = (rows, held_out)
            else:
                self._splits = split_rows(rows, self.eval_fraction, self.seed)
            if not self._splits[0]:
                raise ValueError("task.args.eval_fraction: nothing is left to train on")
        return self._splits

    def _prompt(self, row: Row, split: str) -> Prompt:
        text = row.prompt if not self.instruction else f"{row.prompt}\n\n{self.instruction}"
        return Prompt(prompt_id=f"{split}{row.index}", text=text, answer=row.answer)

    def prompts(self) -> Iterator[Prompt]:
        """Epochs over the training split, each in a fresh seeded order."""
        train, _ = self._load()
        rng = random.Random(self.seed)  # nosec B311 # seeded data order, not security
        while True:
            order = list(range(len(train)))
            rng.shuffle(order)
            for i in order:
                yield self._prompt(train[i], "p")

    def eval_prompts(self, num_prompts: int) -> list[Prompt]:
        _, held_out = self._load()
        return [self._prompt(row, "e") for row in held_out[:num_prompts]]

    def prompt_messages(self, prompt: Prompt) -> list[dict[str, str]]:
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": prompt.text}]

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """1 if the extracted answer equals the reference (math-verify), else 0."""
        from math_verify import parse, verify

        answer = extract_answer(response_text, self.answer_fallback)
        if answer is None:
            return 0.0
        gold = parse(_as_math(prompt.answer))
        guess = parse(_as_math(answer))
        if not gold or not guess:
            return 0.0
        return 1.0 if verify(gold, guess) else 0.0

    def final_answer(self, prompt: Prompt, response_text: str) -> str | None:
        """The answer `reward` checks, in canonical form, for maj@k's vote."""
        answer = extract_answer(response_text, self.answer_fallback)
        return canonical_answer(answer) if answer is not None else None


def _load_math_verify() -> None:
    """Import math-verify now, not in the first reward call, whose timeout
    (task.reward_timeout_s) the import would count against. Its first parse
    after the import costs tens of milliseconds: left to the call."""
    try:
        import math_verify  # noqa: F401 - imported for its side effect: loaded
    except ImportError as err:
        raise ValueError("task.name: math needs the math-verify package: pip install "
                         f"'math-verify[antlr4_13_2]' ({err})") from None


def _as_math(text: str) -> str:
    """Give math-verify an expression it extracts whole: the answer in `$...$`
    unless it carries its own delimiters or \\boxed."""
    text = text.strip()
    if "\\boxed" in text or text.startswith("$") or text.startswith("\\("):
        return text
    return f"${text}$"
