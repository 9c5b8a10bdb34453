"""Prometheus metrics of the scheduler, read from the job store and the live
placements at scrape time. Names follow `reflow_scheduler_<noun>_<unit>`."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from reflow.scheduler.jobs import PHASES

ROLES = ("rollout", "trainer")


class SchedulerCollector:
    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def describe(self):
        return []

    def collect(self):
        counts = dict.fromkeys(PHASES, 0)
        for record in self.scheduler.store.all():
            counts[record.phase] = counts.get(record.phase, 0) + 1
        jobs = GaugeMetricFamily("reflow_scheduler_jobs", "Jobs in the store, by phase.",
                                 labels=["phase"])
        for phase, n in counts.items():
            jobs.add_metric([phase], n)
        yield jobs
        workers = GaugeMetricFamily("reflow_scheduler_workers",
                                    "Workers serving a running job, by role.", labels=["role"])
        by_role = self.scheduler.workers_by_role()
        for role in ROLES:
            workers.add_metric([role], by_role.get(role, 0))
        yield workers
        errors = CounterMetricFamily(
            "reflow_scheduler_kube_api_errors", "Transient cluster API errors (timeouts, 5xx, "
            "429, dropped watches), each retried; by reason.", labels=["reason"])
        for reason, n in sorted(self.scheduler.backend.api_errors.items()):
            errors.add_metric([reason], n)
        yield errors


def scheduler_registry(scheduler) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(scheduler))
    return registry
