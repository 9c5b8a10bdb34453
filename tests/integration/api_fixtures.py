"""The REST API in front of the real scheduler core, over real gRPC, with the
job store in real Redis. Jobs are recorded but not executed: these tests are
about the API, and a job that ran would start vLLM for every generated spec."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import redis
from prometheus_client import CollectorRegistry

from reflow.api.app import ApiSettings, create_app
from reflow.core.limits import OperatorLimits
from reflow.core.paths import PathRoots
from reflow.scheduler.client import GrpcSchedulerClient
from reflow.scheduler.jobcontrol.jobs import JobStore
from reflow.scheduler.cluster.local import LocalBackend
from reflow.scheduler.server import serve
from reflow.scheduler.jobcontrol.service import Scheduler

TOKEN = "test-token-0123456789"


class RecordOnlyScheduler(Scheduler):
    """The real scheduler, except that a submitted job is failed at once instead
    of placed on services."""

    def _run_job(self, record, stop, resume=False, adopted=None) -> None:
        record.phase, record.reason, record.finished_at = "FAILED", "not executed in API tests", time.time()
        self.store.save(record)


@contextmanager
def api_stack(redis_url: str, root: Path, settings: ApiSettings | None = None,
              limits: OperatorLimits | None = None, scheduler_cls=RecordOnlyScheduler):
    """(app, core, registry) with the app talking to the scheduler over gRPC; `root`
    is the runs, the models and the datasets root."""
    core = scheduler_cls(JobStore(redis.Redis.from_url(redis_url)),
                         LocalBackend(redis_url), PathRoots(root, root, root), limits)
    server, port = serve(core, "127.0.0.1:0")
    client = GrpcSchedulerClient(f"127.0.0.1:{port}")
    registry = CollectorRegistry()
    try:
        yield create_app(client, settings or ApiSettings(token=TOKEN), registry), core, registry
    finally:
        client.close()
        server.stop(0)
