"""Example ReFlow plug-ins, installed by an operator and named by a job spec.

ReFlow finds plug-ins through Python entry points, one group per kind; this
package's `pyproject.toml` registers:

- `newest_first` in `reflow.samplers`: `NewestFirstSampler`
- `min_reward` in `reflow.replay_filters`: `MinRewardFilter`

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

from typing import TYPE_CHECKING

from pydantic import BaseModel, ConfigDict, Field

if TYPE_CHECKING:
    import random

    from reflow.replay.plugins import GroupInfo, SampleInfo

__all__ = ["MinRewardFilter", "NewestFirstSampler"]


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
