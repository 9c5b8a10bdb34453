"""A rollout worker's multi-turn side: one episode per sample of a GRPO group
(reflow.rollout.episode), and the group's trajectories from the episodes.

Members of a group play the same prompt, so they share its first render; the
advantage is the job's estimator on the episode rewards of the group's scored
members, exactly as for a single-turn task (rollout/scoring.py), and an episode
whose environment failed is excluded from the loss the same way. For
`algorithm.overlong` an episode's length limit is the task's episode budget
(EpisodeLimits.max_episode_tokens: policy and observation tokens after the
first prompt), and an episode a limit ended (turns, tokens or time: finish_reason
"length") counts as cut. Observation tokens keep their
zero loss mask, so the trainer's importance ratios and token normalisation
count policy tokens only (trainer/loss.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from reflow.core.types import Trajectory
from reflow.rollout.episode import EpisodeResult, run_episode
from reflow.rollout.scoring import GroupScoring, group_trajectories
from reflow.tasks.rewards import RewardResult


@dataclass
class EpisodeCounters:
    """Totals over a worker's episodes, for its metrics."""

    episodes_total: int = 0
    turns_total: int = 0
    tool_calls_total: int = 0
    tool_seconds_total: float = 0.0
    env_seconds_total: float = 0.0


class EpisodeRunner:
    """Plays a multi-turn task's episodes on the worker's engine."""

    def __init__(self, task, renderer) -> None:
        self.task, self.renderer = task, renderer
        self.counters = EpisodeCounters()

    async def play(self, generate, request_id: str, prompt, sampling, current_version):
        result = await run_episode(generate, request_id, self.task.environment(prompt),
                                   self.renderer, self.task.system_prompt, self.task.tools,
                                   sampling, self.task.limits, current_version)
        c = self.counters
        c.episodes_total += 1
        c.turns_total += result.num_turns
        c.tool_calls_total += result.tool_calls
        c.tool_seconds_total += result.tool_seconds
        c.env_seconds_total += result.env_seconds
        return result

    def trajectories(self, group_id: str, episodes: list[EpisodeResult],
                     scoring: GroupScoring | None = None) -> tuple[list[Trajectory],
                                                                    list[RewardResult]]:
        """The group's trajectories and reward results, under the job's `scoring`
        (None: GRPO, nothing else). Every member posed the same first prompt; a
        member whose environment failed to reset has none, and stands in the group
        with that prompt, an empty response and its error."""
        prompt_ids = next((e.prompt_ids for e in episodes if e.prompt_ids), None)
        if prompt_ids is None:
            raise RuntimeError(f"group {group_id}: every episode's environment failed to reset "
                               f"({episodes[0].reward_error})")
        results = [RewardResult(e.reward, e.reward_error) for e in episodes]
        return group_trajectories(group_id, prompt_ids, episodes, results,
                                  loss_masks=[e.loss_mask for e in episodes], scoring=scoring,
                                  max_tokens=self.task.limits.max_episode_tokens), results
