"""Prometheus metrics of the scheduler, read from the job store and the live
placements at scrape time. Names follow `reflow_scheduler_<noun>_<unit>`."""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from reflow import redisconn
from reflow.core import deadline
from reflow.core.errors import Unavailable
from reflow.scheduler.jobcontrol.jobs import PHASES

logger = logging.getLogger(__name__)

ROLES = ("rollout", "trainer")
# How long a scrape waits for a job store that does not answer.
SCRAPE_REDIS_WAIT_S = 2.0


class SchedulerCollector:
    def __init__(self, scheduler) -> None:
        self.scheduler = scheduler

    def describe(self):
        return []

    def collect(self):
        redis_errors = CounterMetricFamily(
            "reflow_scheduler_redis_errors", "Redis errors of the job store's commands, by "
            "kind (connection, timeout, loading) and outcome (retried, or gave_up).",
            labels=["kind", "outcome"])
        for (kind, outcome), n in sorted(redisconn.errors_of(self.scheduler.store.redis).items()):
            redis_errors.add_metric([kind, outcome], n)
        yield redis_errors
        counts: dict[str, int] | None = dict.fromkeys(PHASES, 0)
        try:
            with deadline.scope(SCRAPE_REDIS_WAIT_S):
                for record in self.scheduler.store.all():
                    counts[record.phase] = counts.get(record.phase, 0) + 1
        except Unavailable as err:
            # A job store that does not answer leaves the jobs out of this scrape.
            logger.warning("metrics: the job store is not readable now: %s", err)
            counts = None
        if counts is not None:
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
        yield from self._dispatch()

    def _dispatch(self):
        """The adaptive generation scheduler of each running job (paper §6.1)."""
        caps = GaugeMetricFamily("reflow_scheduler_concurrency_cap",
                                 "Each rollout worker's concurrency cap.", labels=["job_id", "worker"])
        inflight = GaugeMetricFamily("reflow_scheduler_dispatched_inflight_samples",
                                     "Samples dispatched to a worker and not yet ended.",
                                     labels=["job_id", "worker"])
        tokens = GaugeMetricFamily("reflow_scheduler_predicted_kv_tokens",
                                   "T_pred: KV tokens a worker's in-flight samples are predicted "
                                   "to hold.", labels=["job_id", "worker"])
        rejections = CounterMetricFamily(
            "reflow_scheduler_admission_rejections", "Routing attempts of a group that no worker "
            "could take, by what refused it (cap or tokens).", labels=["job_id", "reason"])
        changes = CounterMetricFamily("reflow_scheduler_concurrency_cap_changes",
                                      "Concurrency-cap moves, by reason.",
                                      labels=["job_id", "reason"])
        placement = CounterMetricFamily(
            "reflow_scheduler_placement_recommendations", "Rebalances Algorithm 1 chose (paper "
            "§6.2), by reason (more_rollout, more_trainer), carried out or not.",
            labels=["job_id", "reason"])
        rebalances = CounterMetricFamily(
            "reflow_scheduler_rebalances", "Rebalances carried out with role flips (elastic "
            "jobs), by reason (more_rollout, more_trainer).", labels=["job_id", "reason"])
        flips = CounterMetricFamily(
            "reflow_scheduler_role_flips", "Role flips carried out, by direction.",
            labels=["job_id", "direction"])
        groups = CounterMetricFamily("reflow_scheduler_dispatched_groups",
                                     "Groups dispatched, by worker.", labels=["job_id", "worker"])
        for job_id, snap in sorted(self.scheduler.dispatch_snapshots().items()):
            for name, w in snap["workers"].items():
                caps.add_metric([job_id, name], w["cap"])
                inflight.add_metric([job_id, name], w["inflight"])
                tokens.add_metric([job_id, name], w["predicted_tokens"])
            for reason, n in snap["admission_rejections"].items():
                rejections.add_metric([job_id, reason], n)
            for reason, n in snap["cap_changes"].items():
                changes.add_metric([job_id, reason], n)
            for name, n in snap["dispatched_groups"].items():
                groups.add_metric([job_id, name], n)
            for reason, n in snap["placement_recommendations"].items():
                placement.add_metric([job_id, reason], n)
            # Every label from zero, so a job's rate() has a series before its first flip.
            done = snap.get("rebalances", {})
            for reason in ("more_rollout", "more_trainer"):
                rebalances.add_metric([job_id, reason], done.get(reason, 0))
            done = snap.get("role_flips", {})
            for direction in ("rollout->trainer", "trainer->rollout"):
                flips.add_metric([job_id, direction], done.get(direction, 0))
        yield from (caps, inflight, tokens, rejections, changes, groups, placement, rebalances,
                    flips)


def scheduler_registry(scheduler) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(SchedulerCollector(scheduler))
    return registry
