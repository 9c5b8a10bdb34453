"""The `local` cluster backend: every service of a job runs as its own
process on this machine, on loopback ports, exactly as the container would
run it (`reflow serve <service>`).

It places a job (replay buffer, rollout worker, trainer), waits until each
reports healthy over grpc.health.v1, and tears everything down, process
trees included, when the job ends. Each service also serves Prometheus
metrics on a port of its own; `<run_dir>/endpoints.json` lists them.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
import subprocess  # nosec B404 # only the Popen type; procs.spawn starts the processes

from reflow import procs, redis_acl, rpc, rpcauth
from reflow.core.errors import NoCapacity

logger = logging.getLogger(__name__)


def record_endpoints(run_dir: Path, endpoints: dict[str, dict[str, str]]) -> None:
    """Merge service endpoints into `<run_dir>/endpoints.json`, and write
    `prometheus-targets.json` beside it: a Prometheus file_sd list of every
    service's /metrics, so a local Prometheus can scrape a local run."""
    path = run_dir / "endpoints.json"
    merged = json.loads(path.read_text()) if path.exists() else {}
    merged.update(endpoints)
    path.write_text(json.dumps(merged, indent=2))
    targets = [{"targets": [e["metrics"]], "labels": {"service": name}}
               for name, e in sorted(merged.items()) if e.get("metrics")]
    (run_dir / "prometheus-targets.json").write_text(json.dumps(targets, indent=2))


@dataclass
class ServiceLog:
    service: str
    text: str
    truncated: bool


@dataclass
class Placement:
    replay_address: str
    rollout_addresses: list[str]
    trainer_address: str
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    # An elastic job's AsyncHybrid workers, by index (0 holds trainer rank 0; the
    # rollout addresses are then the engines of workers 1..N-1), and their names
    # (pods on Kubernetes); empty otherwise.
    worker_addresses: list[str] = field(default_factory=list)
    worker_names: list[str] = field(default_factory=list)
    # How each process was started (service, gRPC port, metrics port), so that
    # the job controller can start one again on the same ports after it died.
    launches: dict[str, tuple[str, int, int]] = field(default_factory=dict)
    log_dir: Path | None = None
    colocated: bool = False
    job_id: str = ""

    @property
    def trainer_host(self) -> str:
        """The host the trainer sets its weight-sync group up at, which its rollout
        workers accept joins from (the host of its address, here)."""
        return self.trainer_address.rpartition(":")[0]

    def exited(self) -> list[tuple[str, int, str]]:
        """Services that are gone: (name, exit code, what happened)."""
        return [(name, p.returncode, "exited") for name, p in self.processes.items()
                if p.poll() is not None]

    @property
    def workers(self) -> dict[str, list[str]]:
        """Role -> worker names; local processes have none worth recording."""
        return {}


class LocalBackend:
    def __init__(self, redis_url: str, health_timeout_s: float = 120.0,
                 max_workers: int = 0) -> None:
        """`max_workers`: rollout and trainer processes this machine runs for all
        jobs together (REFLOW_LOCAL_MAX_WORKERS; 0: no limit). A job that does not
        fit waits PENDING, as on a cluster with too few free workers."""
        # The URL the replay buffers it starts log in with (the buffer's Redis user).
        self.redis_url = redis_url
        self.health_timeout_s = health_timeout_s
        self.max_workers = max_workers
        self._in_use: dict[str, int] = {}  # job id -> worker processes it holds
        self._lock = threading.Lock()

    def _take(self, job_id: str, count: int, at_least: int | None = None) -> int:
        """Reserve worker processes for `job_id`: `count`, or as many as are free down
        to `at_least`; NoCapacity below that. Returns the number reserved."""
        with self._lock:
            free = (self.max_workers - sum(self._in_use.values()) if self.max_workers
                    else count)
            need = count if at_least is None else at_least
            if free < need:
                raise NoCapacity(f"job {job_id} needs {need} worker processes and {max(free, 0)} "
                                 f"of REFLOW_LOCAL_MAX_WORKERS={self.max_workers} are free; "
                                 "wait for a job to end")
            took = min(count, free)
            self._in_use[job_id] = self._in_use.get(job_id, 0) + took
            return took

    def _give(self, job_id: str, count: int) -> None:
        with self._lock:
            left = self._in_use.get(job_id, 0) - count
            if left > 0:
                self._in_use[job_id] = left
            else:
                self._in_use.pop(job_id, None)

    def _serve(self, service: str, port: int, metrics_port: int, log_dir: Path,
               colocated: bool = False, log_name: str = ""):
        args = [sys.executable, "-m", "reflow.cli", "serve", service, "--port", str(port)]
        # Only the buffer gets a Redis URL, its own; the rest get none (nor this
        # process's own, which they would inherit otherwise).
        env = {**redis_acl.env_for(service, {"replay": self.redis_url}),
               "REFLOW_METRICS_PORT": str(metrics_port),
               **self._cpu_env(service, colocated),
               # The signing keys stay here; a service gets the public keys only,
               # and its own TLS certificate and key.
               **rpcauth.service_env(), **rpcauth.tls_env(service)}
        # Each service leads a process group that its processes (vLLM's engine core)
        # join: release() finds them even after the service itself died.
        return procs.spawn(args, str(log_dir / f"{log_name or service}.log"), env=env,
                           new_group=True)

    def _cpu_env(self, service: str, colocated: bool = False) -> dict[str, str]:
        """On one machine the rollout engine and the trainer get disjoint cores (what
        separate GPUs are to a cluster). A colocated job (sync mode, verl's hybrid
        engine) gives both every core: they take turns, generation then training, and
        their OpenMP threads wait passively so the idle one releases its cores.
        REFLOW_COLOCATE=0 splits a colocated job too (to measure it both ways);
        REFLOW_PIN_CPUS=0 turns pinning off."""
        if os.environ.get("REFLOW_PIN_CPUS", "1") == "0":
            return {}
        cpus = sorted(os.sched_getaffinity(0))
        rollout_cpus, trainer_cpus = procs.split_cpus(cpus)
        extra: dict[str, str] = {}
        if colocated and os.environ.get("REFLOW_COLOCATE", "1") != "0":
            rollout_cpus = trainer_cpus = cpus
            extra = {"OMP_WAIT_POLICY": "PASSIVE"}
        if service == "rollout":
            # The engine core (the process that runs the model) gets the rollout cores;
            # the front end may use any core. On the rollout core it took a fifth of
            # the engine's time; beside the trainer, whose core idles while it waits
            # for a batch, it costs the trainer's step nothing measurable (bench/PROFILE.md).
            return {"VLLM_CPU_OMP_THREADS_BIND": procs.cpu_list(rollout_cpus),
                    procs.ENGINE_CPU_AFFINITY_ENV: procs.cpu_list(rollout_cpus),
                    procs.CPU_AFFINITY_ENV: procs.cpu_list(cpus), **extra}
        if service == "trainer":
            return {procs.CPU_AFFINITY_ENV: procs.cpu_list(trainer_cpus), **extra}
        if service == "worker":
            # AsyncHybrid workers change roles mid-job, so none is pinned: every one
            # may use every core, and the idle half of each (the engine of a trainer,
            # the replica of a rollout worker) waits passively.
            return {"VLLM_CPU_OMP_THREADS_BIND": procs.cpu_list(cpus),
                    "OMP_WAIT_POLICY": "PASSIVE"}
        return {}

    def place(self, job_id: str, run_dir: Path, colocated: bool = False,
              roles: list[str] | None = None,
              rollout_range: tuple[int, int] | None = None) -> Placement:
        """Start the job's services: the replay buffer, and either rollout processes
        (one, or as many of `rollout_range` as REFLOW_LOCAL_MAX_WORKERS leaves room
        for) and one trainer process, or (`roles`, an elastic job) an AsyncHybrid
        worker per role. Each process gets a gRPC and a metrics port, listed in
        endpoints.json."""
        log_dir = run_dir / "logs"
        log_dir.mkdir(parents=True, exist_ok=True)
        low, high = rollout_range or (1, 1)
        workers = self._take(job_id, len(roles) if roles else 1 + high,
                             at_least=len(roles) if roles else 1 + low)
        # process name -> the service it runs
        services = {"replay": "replay"}
        services.update({f"worker-{i}": "worker" for i in range(len(roles))} if roles
                        else {**{_rollout_name(i): "rollout" for i in range(workers - 1)},
                              "trainer": "trainer"})
        allocated = procs.free_ports(2 * len(services))
        ports = dict(zip(services, allocated))
        metrics_ports = dict(zip(services, allocated[len(services):]))
        address = {name: f"127.0.0.1:{port}" for name, port in ports.items()}
        if roles:
            workers = [address[f"worker-{i}"] for i in range(len(roles))]
            placement = Placement(address["replay"], rollout_addresses=workers[1:],
                                  trainer_address=workers[0], worker_addresses=workers,
                                  worker_names=[f"worker-{i}" for i in range(len(roles))])
        else:
            placement = Placement(address["replay"],
                                  [address[_rollout_name(i)] for i in range(workers - 1)],
                                  address["trainer"])
        placement.job_id = job_id
        record_endpoints(run_dir, {
            name: {"grpc": address[name], "metrics": f"127.0.0.1:{metrics_ports[name]}"}
            for name in services})
        placement.log_dir, placement.colocated = log_dir, colocated
        placement.launches = {name: (service, ports[name], metrics_ports[name])
                              for name, service in services.items()}
        try:
            for name, service in services.items():
                placement.processes[name] = self._serve(service, ports[name], metrics_ports[name],
                                                        log_dir, colocated, log_name=name)
            for name in services:
                rpc.wait_healthy(address[name], self.health_timeout_s, role=services[name])
        except BaseException:
            self.release(placement)
            raise
        logger.info("job %s placed: %s", job_id,
                    {n: p.pid for n, p in placement.processes.items()})
        return placement

    supports_elastic = True

    def restart(self, placement: Placement, name: str) -> None:
        """Start process `name` of a placement again, on the same ports (its clients
        keep their addresses), after it died; returns once it is healthy. What is
        left of the dead one (children it spawned) is taken down first."""
        if name not in placement.launches or placement.log_dir is None:
            raise KeyError(f"{name}: not a process of this placement")
        old = placement.processes.get(name)
        if old is not None:
            # Its process group too: children re-parented when it died (an engine core).
            procs.stop_processes([old], timeout_s=5)
        service, port, metrics_port = placement.launches[name]
        proc = self._serve(service, port, metrics_port, placement.log_dir,
                           placement.colocated, log_name=name)
        placement.processes[name] = proc
        rpc.wait_healthy(f"127.0.0.1:{port}", self.health_timeout_s, role=service,
                         alive=lambda: proc.poll() is None)
        logger.info("%s restarted (pid %d)", name, placement.processes[name].pid)

    def claim_rollout(self, placement: Placement) -> str | None:
        """A new rollout process for the job, its next rollout worker (it grew;
        jobcontrol/resize.py), if REFLOW_LOCAL_MAX_WORKERS leaves room: its address,
        or None."""
        try:
            self._take(placement.job_id, 1)
        except NoCapacity:
            return None
        name = next(_rollout_name(i) for i in range(len(placement.launches) + 1)
                    if _rollout_name(i) not in placement.launches)
        port, metrics_port = procs.free_ports(2)
        address = f"127.0.0.1:{port}"
        placement.launches[name] = ("rollout", port, metrics_port)
        try:
            proc = placement.processes[name] = self._serve(
                "rollout", port, metrics_port, placement.log_dir, placement.colocated,
                log_name=name)
            rpc.wait_healthy(address, self.health_timeout_s, role="rollout",
                             alive=lambda: proc.poll() is None)
        except BaseException:
            self.release_detached(placement, self.detach_rollout(placement, address))
            raise
        placement.rollout_addresses = [*placement.rollout_addresses, address]
        if placement.log_dir is not None:
            record_endpoints(placement.log_dir.parent, {name: {
                "grpc": address, "metrics": f"127.0.0.1:{metrics_port}"}})
        return address

    def detach_rollout(self, placement: Placement, address: str):
        """Rollout process `address` leaves the job (given back): no longer watched nor
        restarted. Returns what `release_detached` stops."""
        name = next(n for n, (service, port, _) in placement.launches.items()
                    if service == "rollout" and f"127.0.0.1:{port}" == address)
        placement.launches = {n: v for n, v in placement.launches.items() if n != name}
        placement.rollout_addresses = [a for a in placement.rollout_addresses if a != address]
        return placement.processes.pop(name, None)

    def release_detached(self, placement: Placement, detached) -> None:
        if detached is not None:
            procs.stop_processes([detached], timeout_s=15)
        self._give(placement.job_id, 1)

    def retire(self, placement: Placement, name: str) -> None:
        """Process `name` of an elastic job died and the job goes on without it: what
        is left of it (children it spawned) is taken down, and it is no longer
        watched."""
        old = placement.processes.pop(name, None)
        if old is not None:
            procs.stop_processes([old], timeout_s=5)

    def release(self, placement: Placement) -> None:
        """Stop the job's services, each with every process it started: first those
        that write to and read from the replay buffer (rollout and trainer, or the
        workers), all at once, then the buffer. Stopped first, the buffer left the
        rollout worker retrying its Put until SIGKILLed 15 s later, on every job,
        while the job still read RUNNING (its phase is saved after this returns)."""
        clients = [p for name, p in placement.processes.items() if name != "replay"]
        buffer = [p for name, p in placement.processes.items() if name == "replay"]
        try:
            procs.stop_processes(clients, timeout_s=15)
            procs.stop_processes(buffer, timeout_s=15)
        finally:
            self._give(placement.job_id, self._in_use.get(placement.job_id, 0))

    def close(self) -> None:
        """Nothing to stop: placements end with their jobs."""

    @property
    def api_errors(self) -> dict[str, int]:
        """No cluster API here."""
        return {}

    def leader_lease(self, name: str, identity: str) -> None:
        """A local scheduler is alone by construction: no lease."""
        return None

    def reclaim_orphans(self, active_job_ids: set[str]) -> list[str]:
        """Nothing to take back: a job's processes die with the scheduler that
        started them (PDEATHSIG), and its engine processes with their rollout
        worker (procs.watch_parent)."""
        return []

    def prepare(self, spec) -> None:
        """Build the model preset once, here, before two services race to load it."""
        from reflow.models.tiny import ensure_model

        ensure_model(spec.model.path, spec.model.build_if_missing, seed=spec.seed)

    @staticmethod
    def read_logs(run_dir: Path, services: list[str], tail_bytes: int,
                  workers: dict[str, list[str]] | None = None) -> list[ServiceLog]:
        """The last `tail_bytes` of each service's log file; a service that has not
        started yet has an empty log."""
        from reflow.core.paths import confine

        out = []
        for service in services:
            path = run_dir / "logs" / f"{service}.log"
            if not path.exists():
                out.append(ServiceLog(service, "", False))
                continue
            # A log file that is a symlink leading out of the run directory is not read.
            path = confine(path, run_dir, f"logs.{service}")
            with open(path, "rb") as f:
                size = f.seek(0, os.SEEK_END)
                f.seek(max(0, size - tail_bytes))
                data = f.read(tail_bytes)
            out.append(ServiceLog(service, data.decode("utf-8", errors="replace"), size > tail_bytes))
        return out


def _rollout_name(i: int) -> str:
    """Local rollout process i's name: `rollout`, then `rollout-1`, `rollout-2`, ..."""
    return "rollout" if i == 0 else f"rollout-{i}"
