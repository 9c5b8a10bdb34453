"""Periodic evaluation on a rollout worker: the held-out prompts, one sample
each, scored like training samples, nothing put to the buffer."""

import asyncio

from reflow.core.config import parse_job_spec
from reflow.rollout.engine import TokenDelta
from reflow.rollout.multiturn import EpisodeRunner
from reflow.rollout.worker import RolloutWorker
from reflow.tasks import TaskContext, build_task
from reflow.tasks.chat import ChatRenderer
from reflow.tasks.repeat import RepeatTask
from tests.unit.fake_engines import PausableEngine
from tests.unit.test_worker_multiturn import TOKENIZER, BadGuesser


class ThreeWords(PausableEngine):
    def __init__(self):
        super().__init__()
        self.temperatures = []

    async def generate(self, request_id, prompt_ids, sampling):
        self.temperatures.append(sampling.temperature)
        await asyncio.sleep(0)
        yield TokenDelta([7, 7, 7], [-0.1] * 3, finished=True, finish_reason="stop")


class NoPuts:
    def put(self, job_id, trajectories):
        raise AssertionError("an evaluation put samples to the buffer")


def _worker(spec, engine, task, **kwargs):
    worker = RolloutWorker("j", spec, lambda: engine, task, NoPuts(), **kwargs)
    worker.start()
    worker.wait_ready(10)
    return worker


def test_an_evaluation_scores_the_held_out_prompts_greedily():
    spec = parse_job_spec({"model": {"path": "/m"}, "rollout": {"temperature": 0.7}})
    task = RepeatTask(8, 3, context=TaskContext(seed=3))
    engine = ThreeWords()
    worker = _worker(spec, engine, task, encode=lambda p: [1, 2], decode=lambda ids: "a a a")
    try:
        result = worker.evaluate(16, greedy=True)
        sampled = worker.evaluate(4, greedy=False)
    finally:
        worker.stop()
    expected = [task.reward(p, "a a a") for p in task.eval_prompts(16)]
    assert result.num_samples == 16 and result.num_errors == 0
    assert abs(result.reward_mean - sum(expected) / 16) < 1e-9
    assert 0 < result.reward_mean < 1  # the split mixes prompts for "a" and others
    assert engine.temperatures == [0.0] * 16 + [0.7] * 4
    assert sampled.num_samples == 4 and result.policy_version == 0
    assert worker.counters.finished_samples_total == 0  # not training samples


def test_a_multi_turn_task_is_evaluated_one_episode_per_prompt():
    spec = parse_job_spec({"model": {"path": "/m"},
                           "task": {"name": "guess_number", "args": {"max_turns": 3}},
                           "rollout": {"group_size": 2}, "trainer": {"batch_size": 4}})
    task = build_task(spec)
    runner = EpisodeRunner(task, ChatRenderer(TOKENIZER))
    worker = _worker(spec, BadGuesser(), task, encode=None, decode=TOKENIZER.decode,
                     episodes=runner)
    try:
        result = worker.evaluate(5, greedy=True)
    finally:
        worker.stop()
    assert result.num_samples == 5 and runner.counters.episodes_total == 5
    assert runner.counters.turns_total == 15
