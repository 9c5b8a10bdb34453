from types import SimpleNamespace

from prometheus_client import generate_latest

from reflow.core.config import parse_job_spec
from reflow.rollout.engine import EngineLoad
from reflow.rollout.metrics import rollout_registry
from reflow.rollout.tasks import RepeatTask
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
