"""A rollout worker running a multi-turn task: each sample of a group is one
episode of at least three turns against the guess_number game, put to the
buffer as one trajectory whose observation tokens are masked out."""

import asyncio
import time

from reflow.core.config import parse_job_spec
from reflow.rollout.engine import TokenDelta
from reflow.rollout.multiturn import EpisodeRunner
from reflow.rollout.worker import RolloutWorker
from reflow.tasks import build_task
from reflow.tasks.chat import ChatRenderer
from tests.unit.chat_tokenizer import build_chat_tokenizer
from tests.unit.fake_engines import PausableEngine

TOKENIZER = build_chat_tokenizer()
IM_END = TOKENIZER.convert_tokens_to_ids("<|im_end|>")


class BadGuesser(PausableEngine):
    """Always guesses 0 and ends its turn: never right, so every episode runs
    until max_turns, each turn answered with feedback."""

    def __init__(self):
        super().__init__()
        self.requests = []

    async def generate(self, request_id, prompt_ids, sampling):
        self.requests.append(request_id)
        await asyncio.sleep(0)
        ids = TOKENIZER.encode("my guess is 0", add_special_tokens=False) + [IM_END]
        yield TokenDelta(ids, [-0.25] * len(ids), finished=True, finish_reason="stop")


class Puts:
    def __init__(self):
        self.trajectories = []

    def put(self, job_id, trajectories):
        self.trajectories += trajectories
        return len(trajectories)


def test_each_sample_is_an_episode_with_observations_masked_out():
    spec = parse_job_spec({"model": {"path": "/m"},
                           "task": {"name": "guess_number", "args": {"max_turns": 4}},
                           "rollout": {"group_size": 2}, "trainer": {"batch_size": 4}})
    task = build_task(spec)
    engine, puts = BadGuesser(), Puts()
    worker = RolloutWorker("j", spec, lambda: engine, task, puts, encode=None,
                           decode=TOKENIZER.decode,
                           episodes=EpisodeRunner(task, ChatRenderer(TOKENIZER)))
    worker.start()
    worker.wait_ready(10)
    try:
        assert worker.submit_group("g0", next(task.prompts()))
        deadline = time.monotonic() + 10
        while len(puts.trajectories) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        worker.stop()
    first, second = puts.trajectories
    assert first.prompt_ids == second.prompt_ids  # one prompt, one first observation
    for t in (first, second):
        # Four policy turns with three observations between them.
        runs, last = [], None
        for m in t.loss_mask:
            if m != last:
                runs.append(m)
                last = m
        assert runs == [1, 0, 1, 0, 1, 0, 1]
        assert all(lp == 0.0 for lp, m in zip(t.logprobs, t.loss_mask) if m == 0)
        assert all(lp == -0.25 for lp, m in zip(t.logprobs, t.loss_mask) if m == 1)
        assert t.reward_error == "" and t.advantage == 0.0  # equal rewards: no signal
    assert len(engine.requests) == 8 and engine.requests[0] == "g0-0-t0"
    counters = worker.episodes.counters
    assert counters.episodes_total == 2 and counters.turns_total == 8
    assert worker.counters.scored_samples_total == 2
