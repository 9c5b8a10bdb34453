"""Tasks: where prompts come from and how a response is scored.

A task yields `Prompt`s and scores a decoded response with a `RewardFn`. It
knows nothing about engines, buffers or training steps.

Built-in task `repeat`: the prompt names a symbol and a count, "c x 1 2 =",
and the correct response is that symbol written count times, "c c ... c",
then end-of-sequence. Counts follow a Zipf-like law (P(k) ∝ 1/k), so most
correct responses are short and a few are very long: the long-tailed length
distribution that makes synchronous RL wait on stragglers (paper §2.2).

Why a tiny random model can learn it: the reward is dense. Each response
token either is the prompt's symbol or is not, so a policy that merely
shifts probability toward the right symbol already earns more, and the
length term rewards stopping near the count. Copying one token from the
prompt and learning when to emit EOS are within reach of two attention
layers trained by GRPO for a few minutes.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field

from reflow.core import plugins


@dataclass(frozen=True)
class Prompt:
    prompt_id: str
    text: str
    # Task-specific ground truth the reward function needs.
    answer: str


class RewardFn(Protocol):
    def __call__(self, prompt: Prompt, response_text: str) -> float:
        """Score a decoded response; 0 (wrong) to 1 (correct)."""
        ...


class Task(Protocol):
    def prompts(self) -> Iterator[Prompt]:
        """An endless, seeded stream of prompts."""
        ...

    def reward(self, prompt: Prompt, response_text: str) -> float: ...


class RepeatTask:
    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

        max_count: int = Field(default=48, ge=1, le=512)
        num_symbols: int = Field(default=6, ge=2, le=26)

    def __init__(self, max_count: int = 48, num_symbols: int = 6, seed: int = 0) -> None:
        if not 2 <= num_symbols <= 26:
            raise ValueError("task.num_symbols must lie in [2, 26]")
        self.max_count = max_count
        self.symbols = list(string.ascii_lowercase[:num_symbols])
        self._rng = random.Random(seed)  # nosec B311 # seeded prompt generation, not security
        self._count_weights = [1.0 / k for k in range(1, max_count + 1)]

    def sample_count(self) -> int:
        return self._rng.choices(range(1, self.max_count + 1), weights=self._count_weights)[0]

    def prompts(self) -> Iterator[Prompt]:
        i = 0
        while True:
            symbol = self._rng.choice(self.symbols)
            count = self.sample_count()
            digits = " ".join(str(count))
            yield Prompt(prompt_id=f"p{i}", text=f"{symbol} x {digits} =", answer=f"{symbol}:{count}")
            i += 1

    def reward(self, prompt: Prompt, response_text: str) -> float:
        """Fraction of response words that are the symbol, times a length match
        min(L, k) / max(L, k). 1.0 exactly for the correct response."""
        symbol, count_text = prompt.answer.split(":")
        count = int(count_text)
        words = response_text.split()
        if not words:
            return 0.0
        matching = sum(1 for w in words if w == symbol)
        length_match = min(len(words), count) / max(len(words), count)
        return (matching / len(words)) * length_match


def build_task(name: str, max_count: int, num_symbols: int, seed: int) -> Task:
    """The registered task `name` (see reflow.core.plugins), seeded."""
    return plugins.build("task", name, {"max_count": max_count, "num_symbols": num_symbols},
                         field="task.name", args_field="task", seed=seed)
