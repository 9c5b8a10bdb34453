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
        c = worker.counters
        for family, name, doc, value in (
            (CounterMetricFamily, "reflow_rollout_generated_tokens", "Tokens generated.",
             c.generated_tokens_total),
            (CounterMetricFamily, "reflow_rollout_finished_samples", "Samples finished.",
             c.finished_samples_total),
            (CounterMetricFamily, "reflow_rollout_idle_seconds", "Time with nothing in flight.",
             worker.idle_seconds()),
            (GaugeMetricFamily, "reflow_rollout_inflight_samples", "Samples generating now.",
             c.inflight_samples),
            (CounterMetricFamily, "reflow_rollout_engine_occupancy_seconds",
             "Engine batch occupancy (running requests / concurrency cap) integrated over time; "
             "its rate is the utilisation.", c.occupancy_seconds_total),
            (CounterMetricFamily, "reflow_rollout_engine_busy_seconds",
             "Time the engine had a request running, unpaused.", c.engine_busy_seconds_total),
            (CounterMetricFamily, "reflow_rollout_engine_decode_steps",
             "Engine steps that generated tokens (busy seconds over steps: the mean step).",
             c.engine_decode_steps_total),
            (GaugeMetricFamily, "reflow_rollout_policy_version", "Policy version loaded.",
             c.policy_version),
        ):
            metric = family(name, doc, labels=["job_id"])
            metric.add_metric([worker.job_id], value)
            yield metric
        scored = CounterMetricFamily("reflow_rollout_scored_samples", "Samples scored.",
                                     labels=["job_id"])
        scored.add_metric([worker.job_id], c.scored_samples_total)
        yield scored
        filtered = CounterMetricFamily(
            "reflow_rollout_filtered_groups", "Groups dynamic sampling dropped (their rewards "
            "were all equal; never put, a new prompt drawn in place).", labels=["job_id"])
        filtered.add_metric([worker.job_id], c.filtered_groups_total)
        yield filtered
        errors = CounterMetricFamily(
            "reflow_rollout_reward_errors", "Samples without a reward, by reason (exception, "
            "timeout, non_finite, crashed, resource_limit, protocol, env_exception, "
            "env_timeout); excluded from the loss.",
            labels=["job_id", "reason"])
        for reason, n in sorted(c.reward_errors_total.items()):
            errors.add_metric([worker.job_id, reason], n)
        yield errors
        if worker.episodes is not None:
            e = worker.episodes.counters
            for name, doc, value in (
                ("reflow_rollout_episodes", "Multi-turn episodes finished.", e.episodes_total),
                ("reflow_rollout_episode_turns", "Policy turns over all episodes (divide by "
                 "episodes for turns per episode).", e.turns_total),
                ("reflow_rollout_tool_calls", "Tool calls the environments ran.",
                 e.tool_calls_total),
                ("reflow_rollout_tool_seconds", "Time in tool calls (divide by tool calls for "
                 "the mean tool latency).", e.tool_seconds_total),
                ("reflow_rollout_env_step_seconds", "Time in environment steps.",
                 e.env_seconds_total),
            ):
                metric = CounterMetricFamily(name, doc, labels=["job_id"])
                metric.add_metric([worker.job_id], value)
                yield metric
        # The engine's own queue (vLLM scheduler stats), when the engine reports it.
        load = getattr(worker.engine, "load", None)
        if load is not None:
            requests = GaugeMetricFamily("reflow_rollout_engine_requests",
                                         "Requests in the engine, by state.", labels=["job_id", "state"])
            requests.add_metric([worker.job_id, "running"], load.running_requests)
            requests.add_metric([worker.job_id, "waiting"], load.waiting_requests)
            yield requests
            kv = GaugeMetricFamily("reflow_rollout_kv_cache_usage_ratio",
                                   "Share of the KV cache in use (0-1).", labels=["job_id"])
            kv.add_metric([worker.job_id], load.kv_cache_usage_ratio)
            yield kv
            preempted = CounterMetricFamily(
                "reflow_rollout_preempted_requests", "Requests the engine preempted, by cause: "
                "kv_cache (no room; what the concurrency controller acts on) or weight_sync "
                "(a weight update's pause).", labels=["job_id", "cause"])
            preempted.add_metric([worker.job_id, "kv_cache"], c.preempted_requests_total)
            preempted.add_metric([worker.job_id, "weight_sync"], c.sync_preempted_requests_total)
            yield preempted


def rollout_registry(service) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(RolloutCollector(service))
    return registry
