"""Example ReFlow plug-ins, installed by an operator and named by a job spec.

ReFlow finds plug-ins through Python entry points, one group per kind; this
package's `pyproject.toml` registers:

- `newest_first` in `reflow.samplers`: `NewestFirstSampler`
- `min_reward` in `reflow.replay_filters`: `MinRewardFilter`
- `unreliable_reward` in `reflow.tasks`: `UnreliableRewardTask`, a task whose
  reward fails on purpose (raises, hangs, returns NaN), to check that a
  deployment isolates rewards: the job goes on and counts the failures

Once the package is installed in the image, a spec uses them by name only:

    replay:
      sampler: newest_first
      replay_filter: min_reward
      filter_args: {threshold: 0.8}

A plug-in's arguments are declared as a pydantic model in its `Args` class
attribute; ReFlow validates the spec's `*_args` against it (unknown keys are
refused) and then instantiates the class with them as keyword arguments.

Only pydantic is needed to import this module: ReFlow's own types are imported
for type checking alone.
"""

from __future__ import annotations

import math
import random
import time
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    from reflow.replay.plugins import GroupInfo, SampleInfo

__all__ = ["MinRewardFilter", "NewestFirstSampler", "UnreliableRewardTask"]


class NewestFirstSampler:
    """Sampler: prefer the freshest groups.

    Ranks candidates by the policy version of their oldest segment, newest first,
    then by arrival, latest first. Takes no arguments. The batch composer takes a
    prefix of the ranking, so batches lean towards the least stale data while the
    replay cap and staleness bound still apply as usual.
    """

    def rank(self, candidates: list[GroupInfo], rng: random.Random) -> list[GroupInfo]:
        return sorted(candidates, key=lambda c: (c.oldest_version, c.created_at), reverse=True)


class MinRewardFilter:
    """Replay filter: replay only samples that scored well.

    After a sample has been trained on, it returns to the replay pool only if
    its reward is at least `threshold`; every other sample is dropped.
    """

    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

        threshold: float = Field(default=0.5, ge=-1e6, le=1e6,
                                 description="Lowest reward a sample may have to be replayed.")

    def __init__(self, threshold: float = 0.5) -> None:
        self.threshold = float(threshold)

    def keep(self, sample: SampleInfo) -> bool:
        return sample.reward >= self.threshold


class _Prompt:
    """A prompt as ReFlow's tasks yield it (reflow.tasks.base.Prompt has the same
    three fields); defined here so that this package does not import reflow."""

    def __init__(self, prompt_id: str, text: str, answer: str) -> None:
        self.prompt_id, self.text, self.answer = prompt_id, text, answer


class UnreliableRewardTask:
    """Task: the prompts of the built-in `repeat` task ("c x 3 =" asks for "c c c"),
    with a reward that fails on purpose every so many calls: it raises, sleeps
    for `sleep_s` (past any sensible reward timeout) or returns NaN. For checking
    a deployment, not for training: ReFlow scores rewards in processes of their
    own with a timeout, so each failure marks one sample (`reward_error`) and the
    job goes on while the failures stay under `task.max_reward_error_rate`.

    The calls are counted per scoring process.
    """

    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

        raise_every: int = Field(default=0, ge=0, le=1_000_000,
                                 description="Every n-th reward raises (0: never).")
        sleep_every: int = Field(default=0, ge=0, le=1_000_000,
                                 description="Every n-th reward sleeps sleep_s (0: never).")
        nan_every: int = Field(default=0, ge=0, le=1_000_000,
                               description="Every n-th reward is NaN (0: never).")
        sleep_s: float = Field(default=60.0, ge=0.0, le=3600.0,
                               description="How long a sleeping reward sleeps.")
        max_count: int = Field(default=8, ge=1, le=512,
                               description="Largest repetition count a prompt asks for.")

    def __init__(self, raise_every: int = 0, sleep_every: int = 0, nan_every: int = 0,
                 sleep_s: float = 60.0, max_count: int = 8, context: Any = None) -> None:
        self.every = {"raise": raise_every, "sleep": sleep_every, "nan": nan_every}
        self.sleep_s, self.max_count = sleep_s, max_count
        self.seed = int(getattr(context, "seed", 0))
        self.calls = 0

    def _stream(self, rng: random.Random, prefix: str):
        i = 0
        while True:
            symbol, count = rng.choice("abcdef"), rng.randint(1, self.max_count)
            yield _Prompt(f"{prefix}{i}", f"{symbol} x {' '.join(str(count))} =",
                          f"{symbol}:{count}")
            i += 1

    def prompts(self):
        return self._stream(random.Random(self.seed), "p")  # nosec B311 # not security

    def eval_prompts(self, num_prompts: int) -> list:
        stream = self._stream(random.Random(self.seed + 1), "e")  # nosec B311
        return [next(stream) for _ in range(num_prompts)]

    def _due(self, what: str) -> bool:
        return bool(self.every[what]) and self.calls % self.every[what] == 0

    def reward(self, prompt, response_text: str) -> float:
        self.calls += 1
        if self._due("raise"):
            raise RuntimeError(f"reward call {self.calls} fails on purpose")
        if self._due("sleep"):
            time.sleep(self.sleep_s)
        if self._due("nan"):
            return math.nan
        symbol, count = prompt.answer.split(":")
        words = response_text.split()
        if not words:
            return 0.0
        right = sum(1 for w in words if w == symbol) / len(words)
        return right * min(len(words), int(count)) / max(len(words), int(count))
