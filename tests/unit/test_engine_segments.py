"""A sample's version segments come from the engine where it labels its weights
(vLLM's weight-version spans): the worker labels every loaded version and takes
the engine's segments over its own notion of "now", which only says when the
tokens reached it (paper §4.1 step 4, partial rollout)."""

import asyncio
import threading
import time
from types import SimpleNamespace

import pytest

from reflow.core.config import parse_job_spec
from reflow.core.types import Segment
from reflow.rollout.engine import EngineLoad, TokenDelta
from reflow.rollout.records import PartialSample
from reflow.tasks import TaskContext
from reflow.tasks.repeat import RepeatTask
from reflow.rollout.vllm_engine import _segments
from tests.unit.fake_engines import PausableEngine


def _span(version, start, end):
    return SimpleNamespace(version=version, start=start, end=end)


def test_spans_become_version_segments():
    spans = [_span("3", 0, 5), _span("4", 5, 5), _span("5", 5, 9)]
    assert _segments(spans, 9) == [(3, 5), (5, 4)]


def test_unlabelled_weights_give_no_segments():
    assert _segments(None, 4) is None
    assert _segments([_span("default", 0, 4)], 4) is None


@pytest.mark.parametrize("spans, n", [
    ([_span("1", 0, 3)], 4),                       # a token without a label
    ([_span("1", 0, 2), _span("2", 3, 4)], 4),     # a gap
    ([_span("default", 0, 2), _span("2", 2, 4)], 4),  # labelled and unlabelled mixed
])
def test_spans_that_do_not_label_every_token_are_refused(spans, n):
    with pytest.raises(ValueError, match="do not label"):
        _segments(spans, n)


def test_partial_sample_merges_segments_and_checks_their_length():
    sample = PartialSample()
    sample.extend([1, 2], [-0.1, -0.2], [(0, 2)])
    sample.extend([3, 4, 5], [-0.3] * 3, [(0, 1), (1, 2)])
    assert sample.segments == [Segment(0, 3), Segment(1, 2)]
    with pytest.raises(ValueError, match="do not cover"):
        sample.extend([6], [-0.1], [(1, 2)])


class LabellingEngine(PausableEngine):
    """Labels its weights as vLLM does and hands each sample over at its end,
    with the labels in force at each token; counts tokens itself."""

    def __init__(self):
        super().__init__()
        self.label = None
        self.labels_seen = []
        self.load = EngineLoad(generated_tokens_total=0)
        self.step = asyncio.Event()

    async def label_weights(self, policy_version):
        self.label = policy_version
        self.labels_seen.append(policy_version)

    async def generate(self, request_id, prompt_ids, sampling):
        first = self.label
        self.load.generated_tokens_total += 2
        await self.step.wait()  # a weight update happens here
        self.load.generated_tokens_total += 1
        yield TokenDelta(token_ids=[3, 4, 5], logprobs=[-0.1] * 3, finished=True,
                         finish_reason="stop", segments=[(first, 2), (self.label, 1)])

    async def resume(self):
        await super().resume()
        self.step.set()


class Puts:
    def __init__(self):
        self.trajectories = []

    def put(self, job_id, trajectories):
        self.trajectories += trajectories
        return len(trajectories)


def test_worker_takes_the_engines_segments_and_token_count():
    from reflow.rollout.worker import RolloutWorker

    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "fully_async",
                           "rollout": {"group_size": 2}, "trainer": {"batch_size": 4}})
    engine = LabellingEngine()
    puts = Puts()
    worker = RolloutWorker("j", spec, lambda: engine, RepeatTask(8, 3, context=TaskContext(seed=0)), puts,
                           encode=lambda text: [1, 2], decode=lambda ids: "a")
    worker.start()
    worker.wait_ready(10)
    try:
        assert worker.submit_group("g", next(RepeatTask(8, 3, context=TaskContext(seed=0)).prompts()))
        time.sleep(0.1)
        update = threading.Thread(target=lambda: worker.call(worker._update_weights(1), 10))
        update.start()
        update.join(5)
        deadline = time.monotonic() + 5
        while len(puts.trajectories) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
        while worker.counters.generated_tokens_total < 6 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        worker.stop()
    assert engine.labels_seen == [0, 1]
    assert [t.segments for t in puts.trajectories] == [[Segment(0, 2), Segment(1, 1)]] * 2
    # Counted by the engine as it sampled, once: not again when the samples arrived.
    assert worker.counters.generated_tokens_total == 6
