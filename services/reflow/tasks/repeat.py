"""The built-in task `repeat`: the prompt names a symbol and a count,
"c x 1 2 =", and the correct response is that symbol written count times,
"c c ... c", then end-of-sequence. Counts follow a Zipf-like law
(P(k) ∝ 1/k), so most correct responses are short and a few are very long:
the long-tailed length distribution that makes synchronous RL wait on
stragglers (paper §2.2).

Why a tiny random model can learn it: the reward is dense. Each response
token either is the prompt's symbol or is not, so a policy that merely
shifts probability toward the right symbol already earns more, and the
length term rewards stopping near the count. Copying one token from the
prompt and learning when to emit EOS are within reach of two attention
layers trained by GRPO for a few minutes.

The prompt is plain text (no chat template): the tiny model's word-level
tokenizer knows only the task's words.
"""

from __future__ import annotations

import random
import string
from collections.abc import Iterator

from pydantic import BaseModel, ConfigDict, Field

from reflow.tasks.base import Prompt, TaskContext

# The held-out split draws from its own seed space, disjoint from any job seed.
EVAL_SEED_OFFSET = 1 << 40


class RepeatTask:
    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

        max_count: int = Field(default=48, ge=1, le=512,
                               description="Largest repetition count a prompt may ask for.")
        num_symbols: int = Field(default=6, ge=2, le=26,
                                 description="How many distinct symbols prompts draw from.")

    def __init__(self, max_count: int = 48, num_symbols: int = 6,
                 context: TaskContext | None = None) -> None:
        if not 2 <= num_symbols <= 26:
            raise ValueError("task.args.num_symbols must lie in [2, 26]")
        self.max_count = max_count
        self.symbols = list(string.ascii_lowercase[:num_symbols])
        self.seed = (context or TaskContext()).seed
        self._rng = random.Random(self.seed)  # nosec B311 # seeded prompt generation, not security
        self._count_weights = [1.0 / k for k in range(1, max_count + 1)]

    def sample_count(self, rng: random.Random | None = None) -> int:
        return (rng or self._rng).choices(range(1, self.max_count + 1),
                                          weights=self._count_weights)[0]

    def _stream(self, rng: random.Random, prefix: str) -> Iterator[Prompt]:
        i = 0
        while True:
            symbol = rng.choice(self.symbols)
            count = self.sample_count(rng)
            digits = " ".join(str(count))
            yield Prompt(prompt_id=f"{prefix}{i}", text=f"{symbol} x {digits} =",
                         answer=f"{symbol}:{count}")
            i += 1

    def prompts(self) -> Iterator[Prompt]:
        return self._stream(self._rng, "p")

    def eval_prompts(self, num_prompts: int) -> list[Prompt]:
        rng = random.Random(self.seed + EVAL_SEED_OFFSET)  # nosec B311 # seeded, not security
        stream = self._stream(rng, "e")
        return [next(stream) for _ in range(num_prompts)]

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

    def final_answer(self, prompt: Prompt, response_text: str) -> str | None:
        """The whole response is the answer: its words, single-spaced (maj@k's vote)."""
        return " ".join(response_text.split()) or None
