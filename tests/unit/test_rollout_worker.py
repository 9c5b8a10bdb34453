"""Each rollout worker of a job samples with its own seed (the prompts come from
the job's one dispatcher: tests/unit/test_dispatch.py)."""

from reflow.core.config import parse_job_spec
from reflow.rollout.service import worker_seed
from tests.unit.fake_engines import PausableEngine


def test_each_rollout_worker_of_a_job_has_its_own_sampling_seed():
    spec = parse_job_spec({"model": {"path": "/m"}, "seed": 7})
    seeds = [worker_seed(spec, rank) for rank in (1, 2, 3)]
    assert seeds[0] == 7 and len(set(seeds)) == 3


def test_ports_handed_out_together_are_distinct():
    from reflow.procs import free_ports

    for _ in range(50):
        ports = free_ports(6)
        assert len(set(ports)) == 6


def test_without_partial_rollout_an_update_waits_for_started_samples_only():
    """verl one_step_off: the update waits for the samples generating under the old
    weights; a group submitted meanwhile waits for the update instead of holding
    it up, then generates under the new version."""
    import asyncio
    import threading
    import time

    from reflow.rollout.engine import TokenDelta
    from reflow.tasks import TaskContext
    from reflow.tasks.repeat import RepeatTask
    from reflow.rollout.worker import RolloutWorker

    class Engine(PausableEngine):
        async def generate(self, request_id, prompt_ids, sampling):
            assert not self.paused, "a request reached a paused engine"
            await asyncio.sleep(0.2)
            yield TokenDelta(token_ids=[3], logprobs=[-0.1], finished=True, finish_reason="stop")

    class Puts:
        def __init__(self):
            self.groups = {}

        def put(self, job_id, trajectories):
            self.groups[trajectories[0].group_id] = trajectories
            return len(trajectories)

    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "one_step_off",
                           "rollout": {"group_size": 2}, "trainer": {"batch_size": 4}})
    puts = Puts()
    worker = RolloutWorker("j", spec, Engine, RepeatTask(8, 3, context=TaskContext(seed=0)), puts,
                           encode=lambda text: [1, 2], decode=lambda ids: "a")
    worker.start()
    worker.wait_ready(10)
    prompts = RepeatTask(8, 3, context=TaskContext(seed=0)).prompts()
    try:
        assert worker.submit_group("old", next(prompts))
        time.sleep(0.05)  # generating under v0
        timings = []
        update = threading.Thread(
            target=lambda: timings.append(worker.call(worker._update_weights(1), 10)))
        update.start()
        time.sleep(0.05)  # the update now waits for "old"
        assert worker.submit_group("new", next(prompts))
        update.join(5)
        assert not update.is_alive(), "the update waited on a group that waits for it"
        # Its pause covers "old" finishing (about 0.15 s of its 0.2 s were left): the
        # trainer counts that wait as idle, not as weight transfer.
        (update_done,) = timings
        assert update_done.pause_s >= 0.1
        deadline = time.monotonic() + 5
        while len(puts.groups) < 2 and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        worker.stop()
    versions = {g: {s.policy_version for t in ts for s in t.segments}
                for g, ts in puts.groups.items()}
    assert versions == {"old": {0}, "new": {1}}


def test_event_log_reads_return_exactly_the_events_after_the_reader(monkeypatch):
    """The dispatcher follows each worker's sample-end events by sequence number: a
    read returns the events after it in order, a reader that fell behind the log gets
    what the log still holds, and a reader at the head waits and gets none."""
    from reflow.rollout import worker as worker_module
    from reflow.tasks import TaskContext
    from reflow.tasks.repeat import RepeatTask
    from reflow.rollout.worker import RolloutWorker

    monkeypatch.setattr(worker_module, "EVENT_LOG_SIZE", 8)
    spec = parse_job_spec({"model": {"path": "/m"}, "rollout": {"group_size": 2},
                           "trainer": {"batch_size": 4}})
    worker = RolloutWorker("j", spec, PausableEngine, RepeatTask(8, 3, context=TaskContext(seed=0)),
                           None, encode=lambda text: [1], decode=lambda ids: "a")
    for i in range(5):
        worker._emit(f"g{i}", 0, response_tokens=i)
    assert [e.seq for e in worker.wait_events(0, 0.0)] == [1, 2, 3, 4, 5]
    assert [(e.seq, e.group_id) for e in worker.wait_events(3, 0.0)] == [(4, "g3"), (5, "g4")]
    assert worker.wait_events(5, 0.01) == []
    for i in range(5, 20):
        worker._emit(f"g{i}", 0)
    # 20 events, the log keeps the newest 8: a reader at 2 gets 13..20.
    assert [e.seq for e in worker.wait_events(2, 0.0)] == list(range(13, 21))
    assert [e.seq for e in worker.wait_events(17, 0.0)] == [18, 19, 20]


def test_a_put_refused_as_the_worker_leaves_rollout_returns_the_group_instead_of_failing():
    """An AsyncHybrid worker moving to the trainer role gets the trainer's job pass
    from the scheduler's call, which may land while a finished group's put is under
    way: the buffer refuses that put (the trainer's pass may not put). The group
    goes back to the dispatcher, as one handed back, and the worker does not fail.
    The same refusal outside a role change still fails it."""
    import time

    from reflow.rollout.records import GROUP_RETURNED
    from reflow.rollout.worker import RolloutWorker
    from reflow.tasks import TaskContext
    from reflow.tasks.repeat import RepeatTask
    from tests.unit.test_dispatch import StaggeredEngine

    class Refused(Exception):
        def code(self):
            return type("Code", (), {"name": "PERMISSION_DENIED"})()

    class RefusingBuffer:
        def put(self, job_id, trajectories):
            time.sleep(0.2)  # the role change's call arrives meanwhile
            raise Refused("ReplayBuffer/Put: rollout only, not a trainer")

    spec = parse_job_spec({"model": {"path": "/m"}, "rollout": {"group_size": 2},
                           "trainer": {"batch_size": 4}})
    prompts = RepeatTask(8, 3, context=TaskContext(seed=0)).prompts()
    for leaving in (True, False):
        worker = RolloutWorker("j", spec, lambda: StaggeredEngine(0.01),
                               RepeatTask(8, 3, context=TaskContext(seed=0)), RefusingBuffer(),
                               encode=lambda text: [1, 2], decode=lambda ids: "a")
        worker.start()
        worker.wait_ready(10)
        try:
            assert worker.submit_group("g", next(prompts))
            time.sleep(0.1)  # generated; the put is under way
            if leaving:
                worker.set_standby(True)
            deadline = time.monotonic() + 10
            ends = []
            while not ends and time.monotonic() < deadline:
                ends = [e for e in worker.wait_events(0, 0.2) if e.sample_index < 0]
            assert ends, "the group never ended"
            if leaving:
                assert ends[0].error == GROUP_RETURNED and worker.state == "running"
            else:
                assert "not a trainer" in ends[0].error and worker.state == "failed"
        finally:
            worker.stop()
