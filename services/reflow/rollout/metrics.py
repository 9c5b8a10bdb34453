"""Prometheus metrics of a rollout worker, read from its counters at scrape
time. Names follow `reflow_rollout_<noun>_<unit>`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


class RolloutCollector:
    def __init__(self, service) -> None:
        self.service = service

    def describe(self):
        return []

    def collect(self):
        worker = self.service.worker
        if worker is None:
            return
        job, c = worker.job_id, worker.counters
        tokens = CounterMetricFamily("reflow_rollout_generated_tokens", "Tokens generated.",
                                     labels=["job"])
        tokens.add_metric([job], c.generated_tokens_total)
        samples = CounterMetricFamily("reflow_rollout_finished_samples", "Samples finished.",
                                      labels=["job"])
        samples.add_metric([job], c.finished_samples_total)
        idle = CounterMetricFamily("reflow_rollout_idle_seconds",
                                   "Time with nothing in flight.", labels=["job"])
        idle.add_metric([job], worker.idle_seconds())
        inflight = GaugeMetricFamily("reflow_rollout_inflight_samples", "Samples generating now.",
                                     labels=["job"])
        inflight.add_metric([job], c.inflight_samples)
        version = GaugeMetricFamily("reflow_rollout_policy_version", "Policy version loaded.",
                                    labels=["job"])
        version.add_metric([job], c.policy_version)
        yield from (tokens, samples, idle, inflight, version)


def rollout_registry(service) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RolloutCollector(service))
    return registry
