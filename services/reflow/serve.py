"""`reflow serve SERVICE`: build one service from the environment, serve it,
and shut it down cleanly on SIGTERM or SIGINT. Every container runs this.

Environment: REFLOW_BACKEND (scheduler: local | kubernetes; see
scheduler/cluster/kube.py for the latter's settings), REDIS_URL (replay, scheduler: each
its own Redis user's, reflow/redis_acl.py; an embedded Redis starts when it is
unset), REFLOW_REPLAY_REDIS_URL (scheduler with the local backend: the URL of the
buffers it starts; its own when unset), REFLOW_DATA_DIR (embedded Redis
data), REFLOW_RUNS_DIR and REFLOW_MODELS_DIR (scheduler, rollout, trainer, worker:
the roots every path in a spec or RPC must lie under), REFLOW_MAX_* (scheduler:
operator ceilings, see core/limits.py), REFLOW_SCHEDULER_ADDRESS,
REFLOW_API_TOKEN(_FILE) and REFLOW_API_MAX_BODY_BYTES (api; without a token the
API refuses to start unless given --insecure-no-auth), REFLOW_REDIS_APPENDFSYNC
(the embedded Redis's fsync policy: everysec, the default, or always),
REFLOW_METRICS_PORT (Prometheus /metrics of every service),
REFLOW_GRPC_CREDENTIAL(_FILE), the signing key of the scheduler or the API
(REFLOW_{SCHEDULER,API}_SIGNING_KEY(_FILE)) and the public keys it verifies by
(REFLOW_{SCHEDULER,API}_PUBLIC_KEY(_FILE)), REFLOW_TLS and REFLOW_TLS_* (see reflow.tlscerts),
REFLOW_SANDBOX_* (sandbox: reflow.sandbox.service.SandboxSettings) and
REFLOW_SECRET_PATHS (sandbox, and reward processes: files hidden from the code they run).
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import time
from pathlib import Path

logger = logging.getLogger("reflow.serve")


def _wait_for_signal() -> None:
    # The handler only appends to a list: one that set a threading.Event could run
    # while the main thread, interrupted inside Event.wait, held the event's lock,
    # and deadlock there (seen: a replay buffer that never exited on SIGTERM).
    received: list[int] = []
    for sig in (signal.SIGTERM, signal.SIGINT):
        # A service that reflow itself started ignores SIGINT (reflow.cli.main):
        # its parent stops it in order.
        if signal.getsignal(sig) is not signal.SIG_IGN:
            signal.signal(sig, lambda signum, _frame: received.append(signum))
    while not received:
        time.sleep(0.2)


def _redis_url() -> tuple[str, object | None]:
    url = os.environ.get("REDIS_URL")
    if url:
        return url, None
    from reflow.replay.embedded import APPENDFSYNC_ENV, EmbeddedRedis, check_appendfsync

    try:
        appendfsync = check_appendfsync(os.environ.get(APPENDFSYNC_ENV, "everysec"),
                                        APPENDFSYNC_ENV)
    except ValueError as err:
        raise SystemExit(f"embedded redis: {err}") from None
    data_dir = Path(os.environ.get("REFLOW_DATA_DIR", ".reflow/redis"))
    embedded = EmbeddedRedis(data_dir, appendfsync=appendfsync).start()
    embedded.supervise()
    return embedded.url, embedded


def _start_metrics_server(registry) -> None:
    """Prometheus /metrics on REFLOW_METRICS_PORT, when it is set."""
    port = os.environ.get("REFLOW_METRICS_PORT")
    if port:
        from prometheus_client import start_http_server

        start_http_server(int(port), registry=registry)
        logger.info("metrics on :%s/metrics", port)


def _check_credentials(name: str) -> None:
    """Refuse to start without the secrets every gRPC call needs (reflow.rpcauth)."""
    from reflow import rpcauth

    try:
        creds = rpcauth.credentials()
        rpcauth.TlsFiles.from_env()  # its TLS settings and files, read before serving
    except (RuntimeError, ValueError, OSError) as err:
        raise SystemExit(f"reflow serve {name}: {err}") from None
    role = name if name in rpcauth.SIGNING_KEY_ENVS else None
    if role is not None and role not in creds.signing:
        env = rpcauth.SIGNING_KEY_ENVS[role]
        raise SystemExit(f"reflow serve {name}: set {env} (or {env}_FILE), the {role}'s "
                         "Ed25519 signing key: this service's calls are control calls")
    # The API serves REST only; every gRPC server verifies the scheduler's calls,
    # and the scheduler the API's.
    needed = set() if name == "api" else {rpcauth.NO_JOB_ROLE}
    if name == "scheduler":
        needed.add("api")
    for missing in sorted(needed - set(creds.trusted)):
        env = rpcauth.PUBLIC_KEY_ENVS[missing]
        raise SystemExit(f"reflow serve {name}: set {env} (or {env}_FILE), the {missing}'s "
                         "public key, to verify its calls by")


def serve_service(name: str, host: str, port: int, insecure_no_auth: bool = False) -> int:
    from reflow.procs import apply_cpu_affinity

    apply_cpu_affinity()
    address = f"{host}:{port}"
    embedded = None
    _check_credentials(name)
    if name == "api":
        return _serve_api(host, port, insecure_no_auth)
    if insecure_no_auth:
        raise SystemExit("--insecure-no-auth applies to `reflow serve api` only")
    if name in ("rollout", "trainer", "worker"):
        # Now, before job threads import it at once: a worker's rollout StartJob and
        # its trainer loop each import it on a thread of their own (reflow.models).
        from reflow.models import import_transformers

        import_transformers()
    if name == "replay":
        from reflow.replay.server import serve
        from reflow.replay.store import ReplayStore

        from reflow.replay.metrics import BufferMetrics

        url, embedded = _redis_url()
        core = ReplayStore.from_url(url)
        metrics = BufferMetrics(core)
        _start_metrics_server(metrics.registry)
        server, _ = serve(core, address, metrics)
        shutdown = lambda: None  # noqa: E731 - all state is in Redis
    elif name == "rollout":
        from reflow.rollout.server import serve
        from reflow.rollout.service import RolloutService

        from reflow.rollout.metrics import rollout_registry

        core = RolloutService()
        _start_metrics_server(rollout_registry(core))
        server, _ = serve(core, address)
        shutdown = core.shutdown
    elif name == "trainer":
        from reflow.trainer.server import serve
        from reflow.trainer.service import TrainerService

        from reflow.trainer.metrics import TrainerMetrics

        metrics = TrainerMetrics()
        core = TrainerService(metrics=metrics)
        _start_metrics_server(metrics.registry)
        server, _ = serve(core, address)
        # SIGTERM (a pod evicted, a `helm upgrade`) stops the job gracefully: the
        # step reached is checkpointed before the process exits.
        shutdown = core.shutdown
    elif name == "worker":
        server, shutdown = _serve_worker(address)
    elif name == "sandbox":
        from reflow.sandbox.server import serve
        from reflow.sandbox.service import SandboxService, SandboxSettings

        try:
            settings = SandboxSettings.from_env()
            core = SandboxService(settings)
        except (ValueError, RuntimeError) as err:
            # A bad REFLOW_SANDBOX_* value, or a machine where bubblewrap cannot run
            # a program: said once, before serving anything.
            raise SystemExit(f"sandbox: {err}") from None
        _start_metrics_server(core.metrics.registry)
        server, _ = serve(core, address)
        shutdown = core.close
    elif name == "scheduler":
        from reflow import redisconn
        from reflow.scheduler.jobcontrol.jobs import JobStore
        from reflow.scheduler.jobcontrol.service import Scheduler
        from reflow.scheduler.server import activate, serve

        url, embedded = _redis_url()
        backend = _cluster_backend(url)
        identity = os.environ.get("REFLOW_POD_NAME") or socket.gethostname()
        lease = backend.leader_lease(os.environ.get("REFLOW_LEASE_NAME", "reflow-scheduler"),
                                     identity)
        # Up and probed at once, a standby until it leads (scheduler/server.py).
        server, _ = serve(None, address)
        if lease is not None:
            # A restarted container keeps its pod's labels: not the leader until it leads.
            backend.mark_leader(identity, False)
            # Before recover(): a standby must not fail the running leader's jobs.
            lease.acquire()
            lease.keep(on_lost=lambda: os.kill(os.getpid(), signal.SIGTERM))
        from reflow.core.limits import OperatorLimits
        from reflow.core.paths import PathRoots

        try:
            limits = OperatorLimits.from_env()
        except ValueError as err:
            raise SystemExit(f"scheduler settings: {err}") from None
        core = Scheduler(JobStore(redisconn.connect(url)), backend, PathRoots.from_env(),
                         limits)
        from reflow.scheduler.metrics import scheduler_registry

        core.recover()
        _start_metrics_server(scheduler_registry(core))
        activate(server, core)
        if lease is not None:
            backend.mark_leader(identity, True)

        def shutdown() -> None:
            # A SIGTERM (helm upgrade, a drained node) hands the jobs over to the
            # next scheduler instead of stopping them (scheduler/jobcontrol/recovery.py).
            core.shutdown(handover=True)
            if lease is not None:
                # The Service loses this endpoint before the standby gains its own.
                backend.mark_leader(identity, False)
                lease.release()
    else:
        raise SystemExit(f"unknown service {name!r}")
    from reflow.procs import tune_gc

    tune_gc()
    _wait_for_signal()
    logger.info("%s: shutting down", name)
    server.stop(grace=5).wait(10)
    shutdown()
    if embedded is not None:
        embedded.stop()
    return 0


def _serve_worker(address: str):
    """An AsyncHybrid worker (paper §5): the rollout, trainer and worker services on
    one gRPC server. A job either gives the pod one fixed role, or (elastic pool)
    starts both halves warm and moves the role with the Worker service's SetRole."""
    from reflow import rpc
    from reflow.rollout import server as rollout_server
    from reflow.rollout.metrics import RolloutCollector
    from reflow.rollout.service import RolloutService
    from reflow.trainer import server as trainer_server
    from reflow.trainer.metrics import TrainerMetrics
    from reflow.trainer.service import TrainerService
    from reflow.worker import server as worker_server
    from reflow.worker.service import HybridWorker

    rollout = RolloutService()
    metrics = TrainerMetrics()
    trainer = TrainerService(metrics=metrics)
    hybrid = HybridWorker(rollout, trainer)
    metrics.registry.register(RolloutCollector(rollout))
    _start_metrics_server(metrics.registry)
    adders = (rollout_server.register(rollout), trainer_server.register(trainer),
              worker_server.register(hybrid))

    def register(server) -> None:
        for add in adders:
            add(server)

    server, _ = rpc.make_server(
        (rollout_server.SERVICE_NAME, trainer_server.SERVICE_NAME, worker_server.SERVICE_NAME),
        register, address,
        long_methods=(rollout_server.LONG_METHODS + trainer_server.LONG_METHODS
                      + worker_server.LONG_METHODS))
    return server, rollout.shutdown


def _cluster_backend(redis_url: str):
    """REFLOW_BACKEND: `local` (processes on this machine) or `kubernetes` (worker
    pods of this release, found and labelled through the Kubernetes API)."""
    backend = os.environ.get("REFLOW_BACKEND", "local")
    if backend == "local":
        from reflow.redis_acl import REPLAY_URL_ENV
        from reflow.scheduler.cluster.local import LocalBackend

        raw = os.environ.get("REFLOW_LOCAL_MAX_WORKERS", "0")
        if not raw.isdigit():
            raise SystemExit(f"REFLOW_LOCAL_MAX_WORKERS: {raw!r} is not a whole number of "
                             "worker processes (0: no limit)")
        return LocalBackend(os.environ.get(REPLAY_URL_ENV) or redis_url,
                            max_workers=int(raw))
    if backend == "kubernetes":
        from reflow.scheduler.cluster.kube import KubernetesBackend

        return KubernetesBackend.from_env()
    raise SystemExit(f"REFLOW_BACKEND: {backend!r} is not one of local, kubernetes")


def _serve_api(host: str, port: int, insecure_no_auth: bool) -> int:
    import uvicorn
    from prometheus_client import CollectorRegistry

    from reflow.api.app import ApiSettings, create_app
    from reflow.scheduler.client import GrpcSchedulerClient

    try:
        settings = ApiSettings.from_env(insecure_no_auth=insecure_no_auth)
    except ValueError as err:
        raise SystemExit(f"api: {err}") from None
    registry = CollectorRegistry()
    _start_metrics_server(registry)
    scheduler = GrpcSchedulerClient(os.environ.get("REFLOW_SCHEDULER_ADDRESS", "127.0.0.1:50051"))
    app = create_app(scheduler, settings, registry)
    uvicorn.run(app, host=host, port=port or 8000, log_level="warning")
    return 0
