"""The built-in multi-turn task `calculator`: arithmetic word problems the
policy may solve with a calculator tool, and the calculator itself.

The calculator evaluates arithmetic on Python's syntax tree and nothing else:
numbers, + - * / // % **, unary signs, parentheses, the constants pi and e and
a few functions (sqrt, abs, min, max, round, floor, ceil). Text from a policy
is hostile input, so nothing is evaluated as code, and every way to make it
slow is bounded before the work is done: the expression's length, its node
count, the exponent, and the magnitude of every intermediate result (so
`9**9**9` is refused at once instead of computing a 370-million-digit number).
Any failure is an error text the policy reads, never an exception.

Tool calls follow the Hermes convention that Qwen- and SmolLM-style chat
templates teach a model given `tools=`: in the assistant's text,
`<tool_call>{"name": "calculator", "arguments": {"expression": "..."}}</tool_call>`,
parsed as strict JSON. A turn without a tool call is the final answer
(`\\boxed{}` or the last number), scored exactly: reward 1 or 0, episode over.
"""

from __future__ import annotations

import ast
import json
import math
import operator
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

from pydantic import Field

from reflow.tasks.base import Prompt, StepResult
from reflow.tasks.env import (
    EnvTask,
    answer_number,
    episode_answer,
    episode_seed,
    final_text,
)

MAX_EXPRESSION_CHARS = 200
MAX_NODES = 64
MAX_EXPONENT = 1000
# Results beyond ±1e15 are refused: floats are exact integers up to 2**53 (~9e15),
# and no operand is ever larger, so one operation costs microseconds.
MAX_ABS_VALUE = 10**15
MAX_FUNCTION_ARGS = 8
MAX_ROUND_DIGITS = 15

TOOL_NAME = "calculator"
TOOL_OPEN, TOOL_CLOSE = "<tool_call>", "</tool_call>"
MAX_TOOL_CALL_CHARS = 1000
MAX_TOOL_CALLS = 4
MAX_ANSWER_CHARS = 40

Number = int | float


class CalculatorError(ValueError):
    """An expression the calculator refuses; the message is what the policy reads."""


def _check(value: Any) -> Number:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise CalculatorError("the result is not a real number")
    if isinstance(value, float) and not math.isfinite(value):
        raise CalculatorError("the result is not a finite number")
    if abs(value) > MAX_ABS_VALUE:
        raise CalculatorError(f"the result is larger than {MAX_ABS_VALUE:.0e}")
    return value


def _divide(op: Callable[[Number, Number], Number]) -> Callable[[Number, Number], Number]:
    def apply(a: Number, b: Number) -> Number:
        if b == 0:
            raise CalculatorError("division by zero")
        return op(a, b)
    return apply


def _power(base: Number, exponent: Number) -> Number:
    if abs(exponent) > MAX_EXPONENT:
        raise CalculatorError(f"the exponent is larger than {MAX_EXPONENT}")
    if base == 0 and exponent < 0:
        raise CalculatorError("division by zero")
    if base < 0 and not float(exponent).is_integer():
        raise CalculatorError("the result is not a real number")
    # Refuse by the size of the result before computing it.
    if abs(base) > 1 and exponent > 0 and exponent * math.log10(abs(base)) > 16:
        raise CalculatorError(f"the result is larger than {MAX_ABS_VALUE:.0e}")
    try:
        return base ** exponent
    except (OverflowError, ZeroDivisionError) as err:
        raise CalculatorError(str(err)) from None


BINARY_OPS: dict[type[ast.operator], Callable[[Number, Number], Number]] = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: _divide(operator.truediv),
    ast.FloorDiv: _divide(operator.floordiv),
    ast.Mod: _divide(operator.mod),
    ast.Pow: _power,
}
UNARY_OPS: dict[type[ast.unaryop], Callable[[Number], Number]] = {
    ast.USub: operator.neg,
    ast.UAdd: operator.pos,
}
CONSTANTS: dict[str, float] = {"pi": math.pi, "e": math.e}


def _sqrt(x: Number) -> Number:
    if x < 0:
        raise CalculatorError("sqrt of a negative number")
    return math.sqrt(x)


def _round(x: Number, digits: Number = 0) -> Number:
    if not isinstance(digits, int) or abs(digits) > MAX_ROUND_DIGITS:
        raise CalculatorError(f"round's digits must be an integer in [-{MAX_ROUND_DIGITS}, "
                              f"{MAX_ROUND_DIGITS}]")
    return round(x, digits) if digits else round(x)


# name: (function, fewest arguments, most arguments)
FUNCTIONS: dict[str, tuple[Callable[..., Number], int, int]] = {
    "sqrt": (_sqrt, 1, 1),
    "abs": (abs, 1, 1),
    "min": (min, 1, MAX_FUNCTION_ARGS),
    "max": (max, 1, MAX_FUNCTION_ARGS),
    "round": (_round, 1, 2),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
}


def _eval(node: ast.AST) -> Number:
    if isinstance(node, ast.Constant):
        if isinstance(node.value, bool) or not isinstance(node.value, (int, float)):
            raise CalculatorError(f"{node.value!r} is not a number")
        return _check(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in BINARY_OPS:
        return _check(BINARY_OPS[type(node.op)](_eval(node.left), _eval(node.right)))
    if isinstance(node, ast.UnaryOp) and type(node.op) in UNARY_OPS:
        return _check(UNARY_OPS[type(node.op)](_eval(node.operand)))
    if isinstance(node, ast.Name):
        if node.id not in CONSTANTS:
            raise CalculatorError(f"unknown name {node.id!r}; constants: pi, e")
        return CONSTANTS[node.id]
    if isinstance(node, ast.Call):
        return _call(node)
    raise CalculatorError(f"{type(node).__name__} is not allowed: only numbers, + - * / // % "
                          f"**, parentheses and {', '.join(FUNCTIONS)}")


def _call(node: ast.Call) -> Number:
    if not isinstance(node.func, ast.Name) or node.func.id not in FUNCTIONS:
        raise CalculatorError(f"unknown function; functions: {', '.join(FUNCTIONS)}")
    fn, fewest, most = FUNCTIONS[node.func.id]
    if node.keywords or any(isinstance(a, ast.Starred) for a in node.args):
        raise CalculatorError(f"{node.func.id} takes plain arguments only")
    if not fewest <= len(node.args) <= most:
        raise CalculatorError(f"{node.func.id} takes {fewest} to {most} arguments")
    args = [_eval(a) for a in node.args]
    try:
        return _check(fn(*args))
    except (ArithmeticError, ValueError) as err:
        if isinstance(err, CalculatorError):
            raise
        raise CalculatorError(f"{node.func.id}: {err}") from None


def evaluate(expression: str) -> Number:
    """The value of an arithmetic expression; CalculatorError (and only that)
    for anything refused."""
    if not isinstance(expression, str):
        raise CalculatorError("the expression must be text")
    if len(expression) > MAX_EXPRESSION_CHARS:
        raise CalculatorError(f"the expression is longer than {MAX_EXPRESSION_CHARS} characters")
    try:
        # A syntax tree only: ast.parse compiles nothing that could run.
        tree = ast.parse(expression.strip(), mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        raise CalculatorError("not an arithmetic expression") from None
    if sum(1 for _ in ast.walk(tree)) > MAX_NODES:
        raise CalculatorError(f"the expression has more than {MAX_NODES} parts")
    return _eval(tree.body)


def format_number(value: Number) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return format(value, ".12g") if isinstance(value, float) else str(value)


def calculate(expression: str) -> str:
    """What the tool answers: the value as text, or `error: ...`."""
    try:
        return format_number(evaluate(expression))
    except CalculatorError as err:
        return f"error: {err}"


@dataclass(frozen=True)
class ToolCall:
    """One `<tool_call>` of a turn; `error` says why it could not be read."""

    name: str = ""
    arguments: dict[str, Any] = field(default_factory=dict)
    error: str = ""


def _read_call(body: str) -> ToolCall:
    if len(body) > MAX_TOOL_CALL_CHARS:
        return ToolCall(error=f"tool call longer than {MAX_TOOL_CALL_CHARS} characters")
    try:
        call = json.loads(body)
    except (ValueError, RecursionError):
        return ToolCall(error='tool call is not JSON; write {"name": ..., "arguments": {...}}')
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        return ToolCall(error='tool call needs a "name" and an "arguments" object')
    arguments = call.get("arguments", {})
    if isinstance(arguments, str):
        # OpenAI-style: the arguments object encoded as a JSON string.
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict):
        return ToolCall(name=call["name"], error='"arguments" must be a JSON object')
    return ToolCall(name=call["name"], arguments=arguments)


def parse_tool_calls(text: str) -> list[ToolCall]:
    """The tool calls of a turn's text, in order (at most MAX_TOOL_CALLS; an
    unclosed or extra one is an error entry). Empty: the turn calls no tool."""
    calls: list[ToolCall] = []
    at = text.find(TOOL_OPEN)
    while at >= 0:
        if len(calls) == MAX_TOOL_CALLS:
            calls.append(ToolCall(error=f"more than {MAX_TOOL_CALLS} tool calls in one turn"))
            break
        end = text.find(TOOL_CLOSE, at)
        if end < 0:
            calls.append(ToolCall(error=f"{TOOL_OPEN} without {TOOL_CLOSE}"))
            break
        calls.append(_read_call(text[at + len(TOOL_OPEN):end].strip()))
        at = text.find(TOOL_OPEN, end + len(TOOL_CLOSE))
    return calls


CALCULATOR_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": TOOL_NAME,
        "description": ("Evaluate an arithmetic expression: numbers, + - * / // % **, "
                        "parentheses, sqrt, abs, min, max, round, floor, ceil."),
        "parameters": {
            "type": "object",
            "properties": {"expression": {"type": "string",
                                          "description": "For example (1234 * 56) - 789"}},
            "required": ["expression"],
        },
    },
}


def _warehouse(rng: random.Random, top: int) -> tuple[str, int]:
    boxes, per_box, arriving = rng.randint(12, top), rng.randint(12, 99), rng.randint(2, 30)
    shipped = rng.randint(1, boxes * per_box)
    question = (f"A warehouse holds {boxes} boxes of {per_box} items each. It ships out "
                f"{shipped} items, then receives {arriving} more boxes of {per_box} items. How "
                "many items does it hold now?")
    return question, boxes * per_box - shipped + arriving * per_box


def _savings(rng: random.Random, top: int) -> tuple[str, int]:
    weekly, weeks, shares = rng.randint(12, top), rng.randint(5, 52), rng.randint(2, 9)
    total = weekly * weeks
    spent = rng.randint(1, total - shares)
    spent += (total - spent) % shares  # so the rest divides evenly
    question = (f"Maya saves ${weekly} every week for {weeks} weeks. She spends ${spent} on a "
                f"bike and splits what is left equally among {shares} charities. How many "
                "dollars does each charity get?")
    return question, (total - spent) // shares


def _journey(rng: random.Random, top: int) -> tuple[str, int]:
    speed1, hours1 = rng.randint(40, max(41, min(top, 300))), rng.randint(2, 19)
    speed2, hours2 = rng.randint(40, max(41, min(top, 300))), rng.randint(2, 19)
    question = (f"A train runs at {speed1} km/h for {hours1} hours, then at {speed2} km/h for "
                f"{hours2} hours. How many kilometres does it travel in all?")
    return question, speed1 * hours1 + speed2 * hours2


def _factory(rng: random.Random, top: int) -> tuple[str, int]:
    per_hour, hours, days = rng.randint(12, top), rng.randint(4, 16), rng.randint(3, 30)
    made = per_hour * hours * days
    defective = rng.randint(1, made // 10)
    question = (f"A factory makes {per_hour} parts an hour, {hours} hours a day, for {days} "
                f"days. {defective} of the parts are defective. How many good parts does it make?")
    return question, made - defective


def _expression(rng: random.Random, top: int) -> tuple[str, int]:
    a, b, c, d = (rng.randint(11, top) for _ in range(4))
    e = rng.randint(2, 99)
    return f"Compute ({a} * {b}) - ({c} * {d}) + {e}.", a * b - c * d + e


PROBLEMS = (_warehouse, _savings, _journey, _factory, _expression)


class CalculatorEnv:
    """One word problem; every turn either calls the calculator or answers."""

    def __init__(self, question: str, answer: int) -> None:
        self.question, self.answer = question, answer

    def reset(self) -> str:
        return self.question

    def step(self, action: str) -> StepResult:
        text = final_text(action)
        calls = parse_tool_calls(text)
        if calls:
            return self._run_tools(calls)
        found = answer_number(text)
        correct = found is not None and _equals(found, self.answer)
        return StepResult(observation="Correct." if correct else "Incorrect.",
                          reward=1.0 if correct else 0.0, done=True,
                          info={"answer": found, "correct": correct})

    def _run_tools(self, calls: list[ToolCall]) -> StepResult:
        results, ran, seconds = [], 0, 0.0
        for call in calls:
            expression = call.arguments.get("expression")
            if call.error:
                results.append(f"error: {call.error}")
            elif call.name != TOOL_NAME:
                results.append(f"error: unknown tool {call.name[:64]!r}; the only tool is "
                               f"{TOOL_NAME!r}")
            elif not isinstance(expression, str):
                results.append('error: the calculator needs {"expression": "<text>"}')
            else:
                started = time.perf_counter()
                results.append(calculate(expression))
                seconds += time.perf_counter() - started
                ran += 1
        return StepResult(observation="\n".join(results), role="tool", tool_calls=ran,
                          tool_seconds=seconds)


def _equals(found: str, answer: int) -> bool:
    if len(found) > MAX_ANSWER_CHARS:
        return False
    try:
        return Fraction(found) == answer
    except (ValueError, ZeroDivisionError):
        return False


class CalculatorTask(EnvTask):
    system_prompt = ("Solve the problem. You may call the calculator tool for arithmetic; "
                     "when you know the answer, reply without a tool call and give the final "
                     "answer as \\boxed{N}.")
    tools = [CALCULATOR_TOOL]

    class Args(EnvTask.Args):
        max_operand: int = Field(default=999, ge=20, le=1_000_000,
                                 description="Largest main quantity a problem draws (prices, "
                                 "counts, rates); larger makes mental arithmetic harder.")

    args: Args

    def _problem(self, seed: int) -> tuple[str, int]:
        rng = random.Random(seed)  # nosec B311 # seeded problems, not security
        return rng.choice(PROBLEMS)(rng, self.args.max_operand)

    def episode_prompt(self, prompt_id: str, episode_seed: int) -> Prompt:
        question, answer = self._problem(episode_seed)
        return Prompt(prompt_id=prompt_id, text=question,
                      answer=episode_answer(episode_seed, result=answer))

    def environment(self, prompt: Prompt) -> CalculatorEnv:
        return CalculatorEnv(*self._problem(episode_seed(prompt)))
