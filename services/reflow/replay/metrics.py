"""Prometheus metrics of the replay buffer.

Counters and pool sizes live in Redis (they survive a restart and are shared
by replicas), so they are read at scrape time by a collector; what a batch
was made of is observed as each batch is leased. Names follow
`reflow_replay_<noun>_<unit>`; the only label besides `pool`/`kind` is the
job id (a handful per buffer, never a sample id). While Redis is down a scrape
still answers, with the Redis error counter and without the stored counters.
"""

from __future__ import annotations

import logging

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from reflow import redisconn
from reflow.core import deadline
from reflow.core.errors import Unavailable
from reflow.replay.store import ReplayStore

logger = logging.getLogger(__name__)

STALENESS_BUCKETS = (0, 1, 2, 3, 4, 6, 8, 16)
# How long a scrape waits for a Redis that does not answer (Prometheus gives up
# after 10 s by default).
SCRAPE_REDIS_WAIT_S = 2.0


class _StoreCollector:
    def __init__(self, store: ReplayStore, jobs: set[str]) -> None:
        self.store = store
        self.jobs = jobs

    def describe(self):
        return []

    def collect(self):
        errors = CounterMetricFamily(
            "reflow_replay_redis_errors", "Redis errors of the buffer's commands, by kind "
            "(connection, timeout, loading) and outcome (retried, or gave_up: the command "
            "failed, UNAVAILABLE to the caller).", labels=["kind", "outcome"])
        for (kind, outcome), n in sorted(redisconn.errors_of(self.store.redis).items()):
            errors.add_metric([kind, outcome], n)
        yield errors
        try:
            with deadline.scope(SCRAPE_REDIS_WAIT_S):
                stats = {job: self.store.stats(job) for job in sorted(self.jobs)}
        except Unavailable as err:
            logger.warning("metrics: the buffer's counters are not readable now: %s", err)
            return
        pools = GaugeMetricFamily("reflow_replay_pool_samples",
                                  "Samples in the buffer by pool.", labels=["job_id", "pool"])
        leases = GaugeMetricFamily("reflow_replay_outstanding_leases",
                                   "Leased batches not yet released.", labels=["job_id"])
        version = GaugeMetricFamily("reflow_replay_policy_version",
                                    "Latest published policy version.", labels=["job_id"])
        counters = {
            "put_total": CounterMetricFamily("reflow_replay_put_samples", "Samples put.", labels=["job_id"]),
            "trained_total": CounterMetricFamily(
                "reflow_replay_trained_samples", "Sample-trainings released, replays included.",
                labels=["job_id"]),
            "evicted_total": CounterMetricFamily(
                "reflow_replay_evicted_samples", "Samples evicted for staleness (δ).", labels=["job_id"]),
            "evicted_unused_total": CounterMetricFamily(
                "reflow_replay_evicted_unused_samples",
                "Samples evicted for staleness before any training (wasted rollouts).",
                labels=["job_id"]),
            "retired_total": CounterMetricFamily(
                "reflow_replay_retired_samples", "Trained samples retired because replay is off.",
                labels=["job_id"]),
            "dropped_total": CounterMetricFamily(
                "reflow_replay_filter_dropped_samples", "Samples the replay filter dropped.",
                labels=["job_id"]),
            "expired_leases_total": CounterMetricFamily(
                "reflow_replay_expired_leases", "Leases that expired unreleased.", labels=["job_id"]),
        }
        for job, s in stats.items():
            pools.add_metric([job, "unused"], s.unused_samples)
            pools.add_metric([job, "replay"], s.replay_samples)
            pools.add_metric([job, "leased"], s.leased_samples)
            leases.add_metric([job], s.outstanding_leases)
            version.add_metric([job], s.policy_version)
            for field, family in counters.items():
                family.add_metric([job], getattr(s, field))
        yield pools
        yield leases
        yield version
        yield from counters.values()


class BufferMetrics:
    def __init__(self, store: ReplayStore, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.jobs: set[str] = set()
        self.registry.register(_StoreCollector(store, self.jobs))
        self.batch_samples = Counter(
            "reflow_replay_batch_samples_total", "Samples served in batches, by kind.",
            ["job_id", "kind"], registry=self.registry)
        self.replay_fraction = Gauge(
            "reflow_replay_batch_replay_fraction_ratio", "Replayed share of the last batch.",
            ["job_id"], registry=self.registry)
        self.staleness = Histogram(
            "reflow_replay_sample_staleness_versions",
            "Policy versions between a served sample's oldest segment and the current one.",
            ["job_id"], buckets=STALENESS_BUCKETS, registry=self.registry)
        self.wait = Histogram(
            "reflow_replay_batch_wait_seconds", "Time a batch request waited.", ["job_id"],
            registry=self.registry)

    def seen(self, job_id: str) -> None:
        self.jobs.add(job_id)

    def observe_batch(self, job_id: str, trajectories, policy_version: int, wait_s: float) -> None:
        """`trajectories`: Trajectory protobuf messages (or anything with `segments`
        of `policy_version`/`num_tokens` and `uses`)."""
        self.seen(job_id)
        kinds = {"fresh": 0, "stale": 0, "replayed": 0}
        for t in trajectories:
            oldest = min((s.policy_version for s in t.segments if s.num_tokens), default=0)
            lag = policy_version - oldest
            self.staleness.labels(job_id).observe(lag)
            kinds["replayed" if t.uses else ("fresh" if lag == 0 else "stale")] += 1
        for kind, n in kinds.items():
            self.batch_samples.labels(job_id, kind).inc(n)
        self.replay_fraction.labels(job_id).set(kinds["replayed"] / max(1, len(trajectories)))
        self.wait.labels(job_id).observe(wait_s)
