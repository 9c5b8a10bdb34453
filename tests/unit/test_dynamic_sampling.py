"""Dynamic sampling (algorithm.dynamic_sampling, DAPO §3.2) and over-long
responses (algorithm.overlong) in the rollout worker, the dispatcher and its
ledger: a group whose rewards are all equal never reaches the buffer, its
grant draws a new prompt, and a sync job still trains on full batches of
informative groups, one batch of dispatch per version."""

import asyncio
import time
from collections import defaultdict
from types import SimpleNamespace

from prometheus_client import generate_latest

from reflow.algorithms.advantages import equal_rewards
from reflow.core.config import parse_job_spec
from reflow.replay.client import InprocReplayClient
from reflow.replay.store import ReplayStore
from reflow.rollout.client import RolloutStats
from reflow.rollout.engine import TokenDelta
from reflow.rollout.metrics import rollout_registry
from reflow.rollout.records import GROUP_FILTERED, SampleEvent
from reflow.rollout.worker import RolloutWorker
from reflow.scheduler.generation.dispatch import Dispatcher
from reflow.scheduler.generation.inflight import DispatchLedger
from reflow.tasks import TaskContext
from reflow.tasks.base import Prompt
from reflow.tasks.repeat import RepeatTask
from reflow.tasks.rewards import RewardResult
from tests.unit.fake_engines import PausableEngine
from tests.unit.test_dispatch import OneWorker


class AnswerEngine(PausableEngine):
    """Sample i answers token 10 + i % 2, `lengths[i]` times (at most max_tokens,
    and then cut: finish_reason "length"), at once."""

    def __init__(self, lengths=(1,)) -> None:
        super().__init__()
        self.lengths = lengths

    async def generate(self, request_id, prompt_ids, sampling):
        index = int(request_id.rsplit("-", 1)[1])
        await asyncio.sleep(0.001)
        n = min(self.lengths[index % len(self.lengths)], sampling.max_tokens)
        yield TokenDelta(token_ids=[10 + index % 2] * n, logprobs=[-0.1] * n, finished=True,
                         finish_reason="length" if n == sampling.max_tokens else "stop")


def _decode(ids):
    return str(ids[0] - 10) if ids else ""


def _score(prompt: Prompt, text: str) -> RewardResult:
    """Stream prompts p0, p3, p6, ... split their group (reward = the sample's
    parity); every other prompt is solved by every sample (reward 1): two groups
    in three carry no signal."""
    if int(prompt.prompt_id.lstrip("p")) % 3 == 0:
        return RewardResult(float(text))
    return RewardResult(1.0)


def _worker(spec, replay, engine=None, job="j"):
    worker = RolloutWorker(job, spec, lambda: engine or AnswerEngine(),
                           RepeatTask(context=TaskContext(seed=0)), replay,
                           encode=lambda prompt: [1, 2], decode=_decode, score=_score)
    worker.start()
    worker.wait_ready(10)
    return worker


def _wait(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert predicate()


class Puts:
    def __init__(self):
        self.trajectories = []

    def put(self, job_id, trajectories):
        self.trajectories += trajectories
        return len(trajectories)


def test_the_worker_drops_an_equal_reward_group_and_says_so():
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "fully_async",
                           "rollout": {"group_size": 2}, "trainer": {"batch_size": 4},
                           "algorithm": {"dynamic_sampling": True}})
    puts = Puts()
    worker = _worker(spec, puts)
    try:
        assert worker.submit_group("flat", Prompt("p1", "x", "a:1"))
        assert worker.submit_group("mixed", Prompt("p3", "x", "a:1"))
        _wait(lambda: sum(e.sample_index < 0 for e in worker.wait_events(0, 0.1)) == 2)
        ends = {e.group_id: e.error for e in worker.wait_events(0, 0.1) if e.sample_index < 0}
    finally:
        worker.stop()
    assert ends == {"flat": GROUP_FILTERED, "mixed": ""}
    assert {t.group_id for t in puts.trajectories} == {"mixed"}
    assert worker.counters.filtered_groups_total == 1 and worker.state == "stopped"
    text = generate_latest(rollout_registry(SimpleNamespace(worker=worker))).decode()
    assert 'reflow_rollout_filtered_groups_total{job_id="j"} 1.0' in text


def test_the_worker_penalises_or_masks_by_the_limit_the_group_was_generated_under():
    puts = Puts()
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "fully_async",
                           "rollout": {"group_size": 2, "max_tokens": 8},
                           "trainer": {"batch_size": 4},
                           "algorithm": {"advantage": "mean_centered", "overlong": "penalty",
                                         "overlong_buffer_tokens": 4}})
    worker = _worker(spec, puts, AnswerEngine(lengths=(2, 6)))
    try:
        # p1 scores 1 for both; lengths 2 and 6. Under the spec's limit 8 (free up
        # to 4) the second pays (6 - 4) / 4; under a curriculum stage's 6 (free up
        # to 2) it pays all of it.
        worker.submit_group("spec", Prompt("p1", "x", "a:1"))
        worker.submit_group("stage", Prompt("p1", "x", "a:1"), bounds=(0, 6))
        _wait(lambda: len(puts.trajectories) == 4)
    finally:
        worker.stop()
    by_group = defaultdict(list)
    for t in puts.trajectories:
        by_group[t.group_id].append((t.reward, t.advantage))
    assert by_group["spec"] == [(1.0, 0.25), (0.5, -0.25)]
    assert by_group["stage"] == [(1.0, 0.5), (0.0, -0.5)]

    puts = Puts()
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "fully_async",
                           "rollout": {"group_size": 2, "max_tokens": 6},
                           "trainer": {"batch_size": 4}, "algorithm": {"overlong": "mask"}})
    worker = _worker(spec, puts, AnswerEngine(lengths=(2, 9)))
    try:
        worker.submit_group("g", Prompt("p3", "x", "a:1"))  # rewards 0 and 1
        _wait(lambda: len(puts.trajectories) == 2)
    finally:
        worker.stop()
    cut = puts.trajectories[1]
    assert cut.finish_reason == "length" and cut.loss_mask == [0] * 6
    # Still in the baseline: GRPO's ±1 (less eps) on rewards 0 and 1.
    assert puts.trajectories[0].advantage < -0.99 and cut.advantage > 0.99


class Budget:
    def __init__(self, limit):
        self.limit, self.granted = limit, 0

    def acquire_dispatch(self, job_id, want, group_size, outstanding_limit, version_limit):
        got = min(want, self.limit - self.granted) // group_size * group_size
        self.granted += got
        return got

    def stats(self, job_id):
        return SimpleNamespace(policy_version=0)


class HoldingWorker:
    """Takes every group and ends none by itself."""

    def __init__(self):
        self.submitted = []

    def submit_group(self, job_id, group_id, prompt, concurrency_cap=0, bounds=None):
        self.submitted.append((group_id, prompt.prompt_id))
        return True

    def wait_events(self, job_id, since_seq, wait_s):
        return []

    def stats(self, job_id):
        return RolloutStats(0, 0, 0.0, 0, 0, "running", "")


def test_a_filtered_group_s_grant_draws_a_new_prompt_and_leaves_the_ledger_with_that_route(
        redis_client):
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "fully_async",
                           "rollout": {"group_size": 2},
                           "trainer": {"batch_size": 4},
                           "algorithm": {"dynamic_sampling": True}})
    ledger = DispatchLedger(redis_client, "led")
    worker, budget = HoldingWorker(), Budget(limit=4)  # two groups' budget, ever
    dispatcher = Dispatcher("led", spec, budget, {"w": worker},
                            RepeatTask(context=TaskContext(seed=0)), ledger=ledger)
    dispatcher.dispatch_round()
    assert [p for _, p in worker.submitted] == ["p0", "p1"]
    first, second = (g for g, _ in worker.submitted)
    dispatcher.apply_events([SampleEvent(1, first, 0), SampleEvent(2, first, 1),
                             SampleEvent(3, first, -1, error=GROUP_FILTERED)])
    assert dispatcher.filtered_groups == 1 and dispatcher.snapshot()["filtered_groups"] == 1
    assert dispatcher.inflight("w") == 2
    # Until its grant is spent the dropped group stays in the ledger: a dispatcher
    # resumed now would route it again on that grant, so no grant is lost.
    position, groups = ledger.load()
    assert position == 2 and {g for g, _ in groups} == {first, second}
    dispatcher.dispatch_round()
    # A new prompt from the stream, on the refunded grant: the buffer granted nothing more.
    assert budget.granted == 4 and [p for _, p in worker.submitted] == ["p0", "p1", "p2"]
    third = worker.submitted[-1][0]
    position, groups = ledger.load()
    assert position == 3 and {g for g, _ in groups} == {second, third}
    # A group that was put (or failed) leaves as before, and takes no grant back.
    dispatcher.apply_events([SampleEvent(4, second, -1)])
    dispatcher.dispatch_round()
    assert len(worker.submitted) == 3 and {g for g, _ in ledger.load()[1]} == {third}


def test_sync_batches_stay_full_and_informative_while_most_groups_are_dropped(redis_client):
    job, batch_size, group, steps = "ds", 8, 2, 4
    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "sync",
                           "rollout": {"group_size": group},
                           "trainer": {"batch_size": batch_size, "num_steps": steps},
                           "algorithm": {"dynamic_sampling": True}})
    store = ReplayStore(redis_client)
    replay = InprocReplayClient(store)
    replay.configure(job, spec.replay)
    ledger = DispatchLedger(redis_client, job)
    worker = _worker(spec, replay, job=job)
    client = OneWorker(worker)
    dispatcher = Dispatcher(job, spec, replay, {"w0": client},
                            RepeatTask(context=TaskContext(seed=1)), ledger=ledger)
    dispatcher.start()
    try:
        for version in range(steps):
            batch = replay.sample(job, batch_size, lease_ttl_s=60, timeout_s=30)
            assert batch is not None and len(batch.trajectories) == batch_size
            rewards = defaultdict(list)
            for t in batch.trajectories:
                rewards[t.group_id].append(t.reward)
            assert len(rewards) == batch_size // group
            assert not any(equal_rewards(r) for r in rewards.values())
            # On-policy: every sample generated under this version...
            assert {(t.oldest_version, t.newest_version) for t in batch.trajectories} == {
                (version, version)}
            # ... and exactly one batch of dispatch per version, drops replaced on
            # their grants: the buffer's bound never had to grant more.
            stats = store.stats(job)
            assert stats.dispatched_total == stats.put_total == batch_size * (version + 1)
            replay.release(job, batch.lease_id)
            if version + 1 < steps:
                # The trainer updates rollout before it publishes to the buffer.
                worker.call(worker._update_weights(version + 1), 10)
                replay.publish_version(job, version + 1)
        _wait(lambda: worker.counters.inflight_samples == 0)
    finally:
        dispatcher.stop()
        worker.stop()
    assert not dispatcher.error
    prompts = [int(p.lstrip("p")) for p in client.prompts]
    assert len(set(prompts)) == len(prompts)  # a dropped group's prompt is not sent again
    dropped = sum(1 for p in prompts if p % 3)
    assert dropped >= steps * batch_size // group  # about two in three
    assert worker.counters.filtered_groups_total == dispatcher.filtered_groups == dropped
    assert len(prompts) == dropped + steps * batch_size // group
    # Nothing left in flight or in hand, and the ledger agrees.
    assert ledger.load() == (len(prompts), [])


def test_the_simulator_drops_and_counts_as_a_worker_does(redis_client, tmp_path):
    """reflow sim's engines score with the worker's GroupScoring: at a reward
    probability of 0.9 about one group of 16 in five is all correct, dropped and
    replaced, and sync still trains on-policy batches."""
    from reflow.sim.run import Simulation
    from tests.unit.test_sim import _small

    config = _small(4)
    config = config.model_copy(update={"job": {**config.job,
                                               "algorithm": {"dynamic_sampling": True}}})
    sim = Simulation(config, "sync", 4, redis_client, tmp_path, report=False)
    sim.run()
    filtered = sum(e.filtered_groups for e in sim.engines.values())
    assert filtered > 0 and sim.dispatcher.filtered_groups == filtered
    assert len(sim.records) == 4 and all(r["max_staleness"] == 0 for r in sim.records)
    assert 0 < sum(r["filtered_groups"] for r in sim.records) <= filtered


def test_the_step_record_counts_the_groups_dropped_during_the_step():
    """Worker counter -> rollout stats -> the trainer's per-step rollout delta ->
    the step record's `filtered_groups`."""
    from reflow.core.types import Batch, Segment, Trajectory
    from reflow.replay.store import BufferStats
    from reflow.rollout.client import InprocRolloutClient
    from reflow.rollout.records import RolloutCounters
    from reflow.trainer.loop import TrainLoop
    from reflow.trainer.loss import LossStats
    from reflow.trainer.records import step_record

    counters = RolloutCounters(filtered_groups_total=3)
    client = InprocRolloutClient(SimpleNamespace(
        stats=lambda job_id: (counters, 0.0, "running", "")))
    assert client.stats("job").filtered_groups_total == 3
    poller = SimpleNamespace(rollouts=[client], _rollout_stats=lambda c: c.stats("job"))
    before = TrainLoop._rollout_totals(poller)
    counters.filtered_groups_total = 8
    delta = TrainLoop._rollout_delta(before, TrainLoop._rollout_totals(poller))
    loop = SimpleNamespace(
        step=2, policy_version=1, learning_rate=1e-4, startup_s=0.0, rollouts=[client],
        job_id="job", group_size=1, membership_epoch=0, group_failures=0,
        retired_engines=[], reference_bytes=0, sync_bytes=0, last_sync_check=0.0,
        replay=SimpleNamespace(stats=lambda job_id: BufferStats()))
    batch = Batch("l", [Trajectory("s0", "g", [1], [2], [-1.0], [1], [Segment(1, 1)],
                                   reward=1.0)], 1)
    stats = (LossStats(loss=0.1, clip_fraction=0.0, approx_kl=0.0, ratio_mean=1.0), 1.0)
    record = step_record(loop, batch, stats, wait_s=0.0, train_s=1.0, sync_s=0.0,
                         sync_wait_s=0.0, step_s=1.0, rollout_delta=delta, wall_s=1.0)
    assert record["filtered_groups"] == 5
