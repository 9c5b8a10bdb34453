from types import SimpleNamespace

from prometheus_client import generate_latest

from reflow.core.config import parse_job_spec
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
    assert 'reflow_rollout_generated_tokens_total{job="job1"} 1234.0' in text
    assert 'reflow_rollout_inflight_samples{job="job1"} 16.0' in text
    assert 'reflow_rollout_policy_version{job="job1"} 7.0' in text
    assert 'reflow_rollout_idle_seconds_total{job="job1"}' in text
