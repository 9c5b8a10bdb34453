"""The metrics reference: every Prometheus metric each service exports, read from
the registries the services build (the same constructors `reflow serve` calls),
not from a list kept beside them. Collectors that read a live service at scrape
time (rollout, scheduler, replay) are collected against `_Blank`, an object that
answers every question with an empty, zero-valued one, so they yield every
family they can without a service behind them."""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from reflow.docgen.text import cell, code, generated_note

# Where each service's registry is built, for the page.
_SOURCES = {
    "api": "reflow/api/middleware.py",
    "scheduler": "reflow/scheduler/metrics.py",
    "replay": "reflow/replay/metrics.py",
    "rollout": "reflow/rollout/metrics.py",
    "trainer": "reflow/trainer/metrics.py",
    "sandbox": "reflow/sandbox/metrics.py",
}


@dataclass(frozen=True)
class MetricDoc:
    name: str  # as exposed: a counter's `_total` included
    kind: str
    labels: tuple[str, ...]
    help: str


class _Blank:
    """Stands in for a live service: any attribute, call or lookup gives another
    blank; it iterates as empty, counts as 0 and has no items."""

    def __getattr__(self, name: str) -> _Blank:
        return _Blank()

    def __call__(self, *args, **kwargs) -> _Blank:
        return _Blank()

    def __iter__(self):
        return iter(())

    def __float__(self) -> float:
        return 0.0

    def items(self):
        return []


def registries() -> dict[str, CollectorRegistry]:
    """Each service's registry, built as the service builds it. (A worker pod serves
    the trainer's and the rollout's together.)"""
    from reflow.api.middleware import RequestMetrics
    from reflow.replay.metrics import BufferMetrics
    from reflow.rollout.metrics import rollout_registry
    from reflow.sandbox.metrics import SandboxMetrics
    from reflow.scheduler.metrics import scheduler_registry
    from reflow.trainer.metrics import TrainerMetrics

    api = CollectorRegistry()
    RequestMetrics(None, api)
    replay = BufferMetrics(_Blank())
    replay.seen("job")  # so the stored counters are read and their families yielded
    return {
        "api": api,
        "scheduler": scheduler_registry(_Blank()),
        "replay": replay.registry,
        "rollout": rollout_registry(_Blank()),
        "trainer": TrainerMetrics().registry,
        "sandbox": SandboxMetrics().registry,
    }


def metric_docs(registry: CollectorRegistry) -> list[MetricDoc]:
    docs: dict[str, MetricDoc] = {}
    # The registry keeps its collectors privately; collect() alone would lose the
    # label names of metrics with no series yet.
    for collector in list(registry._collector_to_names):
        if isinstance(collector, MetricWrapperBase):
            # Read from the collector itself: a labelled metric with no series yet
            # yields a family with no samples, and so no label names.
            docs[collector._name] = MetricDoc(collector._name, collector._type,
                                              tuple(collector._labelnames),
                                              collector._documentation)
            continue
        for family in collector.collect():
            docs[family.name] = MetricDoc(family.name, family.type,
                                          tuple(getattr(family, "_labelnames", ())),
                                          family.documentation)
    return [_exposed(d) for d in sorted(docs.values(), key=lambda d: d.name)]


def _exposed(d: MetricDoc) -> MetricDoc:
    """The name a query uses: prometheus_client keeps a counter's name without
    `_total` and adds it on exposition."""
    if d.kind == "counter":
        return MetricDoc(d.name + "_total", d.kind, d.labels, d.help)
    return d


def page(regs: dict[str, CollectorRegistry] | None = None) -> str:
    regs = regs if regs is not None else registries()
    lines = ["# Metrics reference", "", generated_note("the Prometheus registries each "
             "service builds"), "",
             "Every service serves its metrics on the port `REFLOW_METRICS_PORT` names. Names "
             "follow `reflow_<service>_<noun>_<unit>`; a histogram is exposed as its "
             "`_bucket`, `_sum` and `_count` series. A worker pod serves the trainer's and "
             "the rollout worker's metrics together.", ""]
    for service, registry in regs.items():
        source = _SOURCES.get(service)
        lines += [f"## {service}", ""]
        if source:
            lines += [f"Registered in `{source}`.", ""]
        lines += ["| metric | type | labels | help |", "|---|---|---|---|"]
        for d in metric_docs(registry):
            labels = ", ".join(code(x) for x in d.labels)
            lines.append(f"| {code(d.name)} | {d.kind} | {labels} | {cell(d.help)} |")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"
