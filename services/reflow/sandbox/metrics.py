"""Prometheus metrics of the sandbox service, on a registry of their own (the
server exposes it). Names follow `reflow_sandbox_<noun>_<unit>`; the only label is
an execution's status (reflow.sandbox.types.STATUSES), never a job or request id.
It knows what came of executions, not how they ran."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from reflow.sandbox.types import MEMORY, STATUSES, TIMEOUT, ExecResult

# From a print(1) on a warm pool (a few ms) to the longest wall-clock limit.
EXECUTION_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
                       60.0, 120.0, 600.0)


class SandboxMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.executions = Counter(
            "reflow_sandbox_executions_total", "Executions finished, by status (ok, error, "
            "timeout, memory, output_limit).", ["status"], registry=self.registry)
        self.execution_seconds = Histogram(
            "reflow_sandbox_execution_seconds", "Wall-clock time of an execution, from the "
            "program's start to its end (the wait for a slot not included).",
            buckets=EXECUTION_BUCKETS_S, registry=self.registry)
        self.timeouts = Counter(
            "reflow_sandbox_timeouts_total", "Executions killed past their wall-clock or "
            "CPU-time limit.", registry=self.registry)
        self.memory_kills = Counter(
            "reflow_sandbox_memory_kills_total", "Executions ended by their memory limit "
            "(MemoryError, or killed for memory).", registry=self.registry)
        self.rejected = Counter(
            "reflow_sandbox_rejected_total", "Requests refused before running (invalid, "
            "or the queue full).", registry=self.registry)
        self.cold_starts = Counter(
            "reflow_sandbox_cold_starts_total", "Executions that found no warm sandbox "
            "waiting and started their own.", registry=self.registry)
        self.queue_depth = Gauge(
            "reflow_sandbox_queue_depth", "Requests waiting for a free execution slot.",
            registry=self.registry)
        self.running = Gauge(
            "reflow_sandbox_running", "Executions running now.", registry=self.registry)
        self.warm_processes = Gauge(
            "reflow_sandbox_warm_processes", "Sandboxes started and waiting for a program.",
            registry=self.registry)
        for status in STATUSES:  # every series from the first scrape, at 0
            self.executions.labels(status)

    def observe(self, result: ExecResult) -> None:
        self.executions.labels(result.status).inc()
        self.execution_seconds.observe(result.wall_s)
        if result.status == TIMEOUT:
            self.timeouts.inc()
        elif result.status == MEMORY:
            self.memory_kills.inc()

