from types import SimpleNamespace

from prometheus_client import generate_latest

from reflow.core.config import parse_job_spec
from reflow.rollout.engine import EngineLoad
from reflow.rollout.metrics import rollout_registry
from reflow.tasks.repeat import RepeatTask
from reflow.rollout.worker import RolloutWorker


def test_rollout_metrics_read_the_workers_counters():
    spec = parse_job_spec({"model": {"path": "/m"}})
    worker = RolloutWorker("job1", spec, lambda: None, RepeatTask(), replay=None,
                           encode=lambda t: [], decode=lambda ids: "")
    worker.counters.generated_tokens_total = 1234
    worker.counters.inflight_samples = 16
    worker.counters.policy_version = 7
    service = SimpleNamespace(worker=None)
    registry = rollout_registry(service)
    assert "reflow_rollout" not in generate_latest(registry).decode()  # no job yet
    service.worker = worker
    text = generate_latest(registry).decode()
    assert 'reflow_rollout_generated_tokens_total{job_id="job1"} 1234.0' in text
    assert 'reflow_rollout_inflight_samples{job_id="job1"} 16.0' in text
    assert 'reflow_rollout_policy_version{job_id="job1"} 7.0' in text
    assert 'reflow_rollout_idle_seconds_total{job_id="job1"}' in text
    assert "reflow_rollout_engine_requests" not in text  # this engine reports no queue
    worker.engine = SimpleNamespace(load=EngineLoad(running_requests=3, waiting_requests=5,
                                                    kv_cache_usage_ratio=0.25))
    text = generate_latest(registry).decode()
    assert 'reflow_rollout_engine_requests{job_id="job1",state="running"} 3.0' in text
    assert 'reflow_rollout_engine_requests{job_id="job1",state="waiting"} 5.0' in text
    assert 'reflow_rollout_kv_cache_usage_ratio{job_id="job1"} 0.25' in text


def test_preemptions_of_a_weight_update_are_not_kv_pressure():
    """The engine counts requests a weight update's pause dropped from the KV cache
    as preemptions; the worker books those apart (cause weight_sync), so the
    concurrency controller only sees preemptions for room (cause kv_cache)."""
    import asyncio
    import time

    class Engine:
        def __init__(self):
            self.load = EngineLoad()

        async def pause(self):
            self.load.preempted_requests_total += 5  # every running request, as vLLM does

        async def resume(self):
            pass

        async def receive_weights(self):
            await asyncio.sleep(0.05)
            return 0.05

        def shutdown(self):
            pass

    spec = parse_job_spec({"model": {"path": "/m"}})
    engine = Engine()
    worker = RolloutWorker("job1", spec, lambda: engine, RepeatTask(), replay=None,
                           encode=lambda t: [], decode=lambda ids: "")
    worker.start()
    worker.wait_ready(10)
    try:
        worker.call(worker._update_weights(1), 10)
        time.sleep(0.1)
        engine.load.preempted_requests_total += 2  # later, for room
        time.sleep(0.5)  # past the update's window
        engine.load.preempted_requests_total += 3
        time.sleep(0.1)
    finally:
        worker.stop()
    assert worker.counters.sync_preempted_requests_total == 7
    assert worker.counters.preempted_requests_total == 3
    text = generate_latest(rollout_registry(SimpleNamespace(worker=worker))).decode()
    assert ('reflow_rollout_preempted_requests_total{cause="kv_cache",job_id="job1"} 3.0'
            in text)
    assert ('reflow_rollout_preempted_requests_total{cause="weight_sync",job_id="job1"} 7.0'
            in text)


def test_a_draining_weight_update_counts_the_engine_s_decoding_as_busy():
    """one_step_off's update lets the samples in flight finish under the old weights
    before the engine pauses: the engine decodes meanwhile, and its busy time and
    occupancy say so (they stop only once it is paused)."""
    import asyncio
    import threading
    import time

    from reflow.rollout.engine import TokenDelta
    from reflow.tasks import TaskContext

    class Engine:
        def __init__(self):
            self.load = EngineLoad(generated_tokens_total=0)
            self.release = asyncio.Event()
            self.started = 0

        async def generate(self, request_id, prompt_ids, sampling):
            self.started += 1
            self.load.running_requests = self.started
            await self.release.wait()
            self.load.running_requests = 0
            yield TokenDelta(token_ids=[3], logprobs=[-0.1], finished=True, finish_reason="stop")

        async def pause(self):
            pass

        async def resume(self):
            pass

        async def receive_weights(self):
            return 0.0

        def shutdown(self):
            pass

    class Puts:
        def put(self, job_id, trajectories):
            return len(trajectories)

    spec = parse_job_spec({"model": {"path": "/m"}, "mode": "one_step_off",
                           "rollout": {"group_size": 2}, "trainer": {"batch_size": 4}})
    assert not spec.rollout.partial_rollout
    engine = Engine()
    task = RepeatTask(8, 3, context=TaskContext(seed=0))
    worker = RolloutWorker("job1", spec, lambda: engine, task, Puts(),
                           encode=lambda t: [1, 2], decode=lambda ids: "a")
    worker.start()
    worker.wait_ready(10)
    try:
        assert worker.submit_group("g", next(task.prompts()), 2)
        deadline = time.monotonic() + 5
        while engine.started < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        update = threading.Thread(target=lambda: worker.call(worker._update_weights(1), 10))
        update.start()
        time.sleep(0.05)
        busy, occupancy = (worker.counters.engine_busy_seconds_total,
                           worker.counters.occupancy_seconds_total)
        # The update drains, and waits on the samples (released below) however long
        # that takes: their decoding keeps counting meanwhile, whatever the load.
        deadline = time.monotonic() + 30
        while (worker.counters.engine_busy_seconds_total - busy < 0.3
               or worker.counters.occupancy_seconds_total - occupancy < 0.3):
            assert time.monotonic() < deadline, "the drain's decoding was not counted"
            time.sleep(0.02)
        assert update.is_alive() and worker.counters.policy_version == 0
        worker._loop.call_soon_threadsafe(engine.release.set)
        update.join(5)
        assert not update.is_alive() and worker.counters.policy_version == 1
        time.sleep(0.1)
        busy = worker.counters.engine_busy_seconds_total
        time.sleep(0.2)  # nothing in flight now
        assert worker.counters.engine_busy_seconds_total == busy
    finally:
        worker.stop()
