"""`reflow run`: a whole job on this machine, every service its own process.

Starts an embedded Redis (append-only, in the run directory, one user per role
with passwords drawn afresh at each start: reflow/redis_acl.py), the scheduler
and the API (with a random bearer token for this run, in `<run_dir>/api-token`,
mode 0600); submits the job to the scheduler, which places the replay
buffer, rollout worker and trainer with its local backend; shows progress
from the API; and writes summary.json and report.png at the end. Ctrl-C stops
the job and ends every process it started, vLLM's engine included.

The services speak mutual TLS, each with its role's certificate from a CA made
for this launch (`<run_dir>/tls`, reflow.tlscerts); `--insecure-plaintext` (or
REFLOW_TLS=off) turns TLS off for debugging, and says so.

A job whose task runs code (its class declares `needs_sandbox = True`) gets a
sandbox service too (reflow.sandbox), started first and stopped last: every
process of the job finds it at REFLOW_SANDBOX_ADDRESS, and it hides the run's
secret files from the programs it runs as reward processes do.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import signal
import sys
import threading
import time
from datetime import datetime
from pathlib import Path

from reflow.core.config import JobSpec, dump_job_spec
from reflow.core.paths import MODELS_ROOT_ENV, RUNS_ROOT_ENV
from reflow.scheduler.jobcontrol.jobs import TERMINAL

logger = logging.getLogger(__name__)


# Consecutive failed status polls (about a second apart) before `reflow run` gives up.
MAX_STATUS_FAILURES = 60


def progress_line(job: dict, num_steps: int, elapsed_s: float) -> str:
    """The status line for one GET /v1/jobs/{id} reply."""
    done = min(1.0, job["step"] / max(1, num_steps))
    bar = "#" * int(done * 24) + "-" * (24 - int(done * 24))
    return (f"[{bar}] step {job['step']}/{num_steps}  {job['phase'].lower():<9} "
            f"reward {job['reward_mean']:.3f}  {job['trainer_tokens_per_s']:.0f} tok/s  "
            f"v{job['policy_version']}  {elapsed_s:5.0f}s")


class _Progress:
    """One status line: redrawn in place on a terminal, printed every 10 s otherwise.
    The line of a job that has ended is always printed, so the last one shows its
    final phase (a run's last step is reported while the job is still running)."""

    def __init__(self, num_steps: int) -> None:
        self.num_steps = num_steps
        self.tty = sys.stdout.isatty()
        self._last_print = 0.0
        self._start = time.monotonic()

    def show(self, job: dict) -> None:
        line = progress_line(job, self.num_steps, time.monotonic() - self._start)
        if self.tty:
            # Clear to the end of the line: the new line may be shorter than the last.
            print("\r" + line + "\x1b[K", end="", flush=True)
        elif job["phase"] in TERMINAL or time.monotonic() - self._last_print >= 10.0:
            print(line, flush=True)
            self._last_print = time.monotonic()

    def close(self) -> None:
        if self.tty:
            print()


def _start(service: str, port: int, run_dir: Path, env: dict[str, str]):
    from reflow import procs

    from reflow import rpcauth

    args = [sys.executable, "-m", "reflow.cli", "serve", service, "--port", str(port)]
    # Each gets the public keys, and only its own role's signing key and TLS key.
    return procs.spawn(args, str(run_dir / "logs" / f"{service}.log"),
                       env={**env, **rpcauth.role_env(service), **rpcauth.tls_env(service)})


# How long the scheduler gets to stop a job in order (a checkpoint included).
STOP_GRACE_S = 120.0


def needs_sandbox(spec: JobSpec) -> bool:
    """Whether the job's task runs code in the sandbox: its class says so with
    `needs_sandbox = True` (default False)."""
    from reflow.core import plugins

    task = plugins.resolve("task", spec.task.name, "task.name")
    return bool(getattr(task, "needs_sandbox", False))


class SandboxProcess:
    """The run's sandbox service, on ports of its own, listed in endpoints.json (and
    so in prometheus-targets.json). `env` is what every service of the run gets
    (REFLOW_SECRET_PATHS among it: what the sandbox hides from its programs).

    `supervise` starts it again on the same ports whenever it dies (kill -9, an OOM
    kill), up to `max_restarts` times: an execution in flight comes back
    UNAVAILABLE and the rollout worker's client sends it again into the restart
    (reflow.sandbox.grpc_client, `retry_s`), so the job's episodes ride out the gap
    rather than fail. A sandbox keeps nothing between executions: a restart loses
    nothing but the warm pool."""

    def __init__(self, run_dir: Path, env: dict[str, str]) -> None:
        from reflow import procs
        from reflow.scheduler.cluster.local import record_endpoints

        port, metrics_port = procs.free_ports(2)
        self.run_dir = run_dir
        self.address = f"127.0.0.1:{port}"
        record_endpoints(run_dir, {"sandbox": {"grpc": self.address,
                                               "metrics": f"127.0.0.1:{metrics_port}"}})
        self._start_args = ("sandbox", port, run_dir,
                            {**env, "REFLOW_METRICS_PORT": str(metrics_port)})
        self.proc = _start(*self._start_args)
        self.restarts = 0
        self._stopping = threading.Event()
        self._lock = threading.Lock()

    def wait(self, timeout_s: float = 60.0) -> None:
        wait_sandbox(self.proc, self.address, self.run_dir, timeout_s)

    def supervise(self, max_restarts: int = 5, poll_s: float = 0.5) -> threading.Thread:
        def watch() -> None:
            while not self._stopping.wait(poll_s):
                with self._lock:
                    if self._stopping.is_set() or self.proc.poll() is None:
                        continue
                    if self.restarts >= max_restarts:
                        logger.error("the sandbox exited (code %s) %d times; not restarted "
                                     "again", self.proc.returncode, self.restarts + 1)
                        return
                    self.restarts += 1
                    logger.warning("the sandbox exited (code %s); restarting it at %s "
                                   "(restart %d of %d)", self.proc.returncode, self.address,
                                   self.restarts, max_restarts)
                    self.proc = _start(*self._start_args)

        thread = threading.Thread(target=watch, name="sandbox-supervisor", daemon=True)
        thread.start()
        return thread

    def stop(self, timeout_s: float) -> None:
        from reflow import procs

        with self._lock:
            self._stopping.set()
        procs.stop_gracefully(self.proc, timeout_s=timeout_s)


def wait_sandbox(proc, address: str, run_dir: Path, timeout_s: float = 60.0) -> None:
    """Until the sandbox answers healthy. RuntimeError quoting its log as soon as
    it exits instead (it refuses to start where bubblewrap cannot run a program,
    and says why), TimeoutError after `timeout_s`."""
    from reflow import rpc

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            rpc.wait_healthy(address, 1.0, role="sandbox")
            return
        except TimeoutError:
            if proc.poll() is not None:
                log = (run_dir / "logs" / "sandbox.log").read_text(errors="replace")
                raise RuntimeError(f"the sandbox exited ({proc.returncode}) before it "
                                   f"served: {log.strip()[-2000:]}") from None
            if time.monotonic() >= deadline:
                raise


def run_local(spec: JobSpec, out: str | None, resume_job_id: str = "",
              appendfsync: str = "everysec", plaintext: bool = False) -> int:
    """Run `spec` as a whole local stack; with `resume_job_id`, continue that job of
    the run in `out` (its Redis, in `<out>/redis`, still holds the job, its buffer
    and its dispatch ledger) from its newest checkpoint. `appendfsync`: when that
    Redis fsyncs its append-only file (replay.embedded.APPENDFSYNC). `plaintext`:
    gRPC without TLS (--insecure-plaintext)."""
    import httpx

    from reflow import procs, redis_acl, rpc, rpcauth
    from reflow.replay.embedded import EmbeddedRedis
    from reflow.report import plot, read_metrics, summarize
    from reflow.scheduler.client import GrpcSchedulerClient
    from reflow.core.errors import FailedPrecondition, NotFound
    from reflow.scheduler.cluster.local import record_endpoints
    from reflow.sandbox.client import ADDRESS_ENV as SANDBOX_ADDRESS_ENV
    from reflow.tasks.confine import SECRET_PATHS_ENV

    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    run_dir = Path(out or f"runs/{spec.name}-{stamp}").absolute()
    if (run_dir / "metrics.jsonl").exists() and not resume_job_id:
        print(f"error: {run_dir} already holds a run; pick another --out, or continue it "
              f"with `reflow run --resume {run_dir}`", file=sys.stderr)
        return 2
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    if not resume_job_id:
        (run_dir / "config.yaml").write_text(dump_job_spec(spec))

    started = []
    redis = sandbox = None
    # SIGTERM ends a run like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    job_id = resume_job_id or f"{spec.name}-{stamp}"
    phase, reason = "FAILED", ""
    scheduler = None
    try:
        # This run's gRPC credential and signing keys (rpcauth); each service it
        # starts gets its share (`_start`).
        rpcauth.ensure_local_credentials()
        # And its TLS: a new CA and per-role certificates at every start, a resume's
        # too; this process calls the scheduler as the API does, with the API's.
        from reflow.tlscerts import setup_local_run

        warning = setup_local_run(run_dir / "tls", plaintext=plaintext)
        if warning:
            print(warning, file=sys.stderr, flush=True)
        # New passwords at every start, a resume's too: only their hashes reach the
        # disk (the ACL file beside the data), and each service gets its own user's URL.
        redis = EmbeddedRedis(run_dir / "redis", appendfsync=appendfsync,
                              passwords=redis_acl.Passwords.mint()).start()
        # A Redis that dies mid-run comes back on its port from its append-only file.
        redis.supervise()
        # The roots this run's services accept paths under: the run directory's
        # parent, and the models root (by default the directory holding the spec's
        # model: `reflow run` trusts its own command line, not the network).
        models_root = os.environ.get(MODELS_ROOT_ENV) or str(Path(spec.model.path).parent)
        env = {RUNS_ROOT_ENV: str(run_dir.parent), MODELS_ROOT_ENV: models_root}
        # What reward processes hide from themselves (reflow.tasks.confine), and the
        # sandbox from its programs: every role's TLS key, the API's token, and
        # Redis's ACL and append-only files (which a Redis restarted by `supervise`
        # would load, rewritten or not).
        env[SECRET_PATHS_ENV] = os.pathsep.join(filter(None, [
            os.environ.get(SECRET_PATHS_ENV, ""),
            *(str(run_dir / name) for name in ("tls", "api-token", "redis"))]))
        redis_urls = {user: redis.url_for(user) for user in redis_acl.USER_NAMES}
        if needs_sandbox(spec):
            sandbox = SandboxProcess(run_dir, env)
            # Every service of the job inherits it from the scheduler: the rollout
            # workers, and the AsyncHybrid workers that may become one.
            env[SANDBOX_ADDRESS_ENV] = sandbox.address
        sched_port, api_port, sched_metrics, api_metrics = procs.free_ports(4)
        record_endpoints(run_dir, {
            "scheduler": {"grpc": f"127.0.0.1:{sched_port}", "metrics": f"127.0.0.1:{sched_metrics}"},
            "api": {"http": f"127.0.0.1:{api_port}", "metrics": f"127.0.0.1:{api_metrics}"},
        })
        started.append(_start("scheduler", sched_port, run_dir,
                              {**env, "REFLOW_METRICS_PORT": str(sched_metrics),
                               **redis_acl.env_for("scheduler", redis_urls)}))
        env["REFLOW_SCHEDULER_ADDRESS"] = f"127.0.0.1:{sched_port}"
        # Auth is on here too: a random token for this run, readable by its owner only.
        token = secrets.token_urlsafe(32)
        token_file = run_dir / "api-token"
        token_file.touch(mode=0o600)
        token_file.write_text(token + "\n")
        started.append(_start("api", api_port, run_dir,
                              {**env, "REFLOW_METRICS_PORT": str(api_metrics),
                               "REFLOW_API_TOKEN_FILE": str(token_file),
                               **redis_acl.env_for("api", redis_urls)}))
        # The Scheduler service, not the process: a scheduler serves health while it
        # still recovers its jobs (scheduler/server.py).
        rpc.wait_healthy(f"127.0.0.1:{sched_port}", 60, service="reflow.v1.Scheduler",
                         role="scheduler")
        if sandbox is not None:
            sandbox.wait()
            sandbox.supervise()
        api = f"http://127.0.0.1:{api_port}"
        wait_http(f"{api}/healthz", 60)
        headers = {"Authorization": f"Bearer {token}"}
        scheduler = GrpcSchedulerClient(f"127.0.0.1:{sched_port}")
        if resume_job_id:
            try:
                scheduler.resume(job_id)
            except NotFound:
                print(f"error: the run's Redis ({run_dir / 'redis'}) no longer holds job "
                      f"{job_id}: its buffer and dispatch ledger are gone, so a resume would "
                      "skip or repeat samples", file=sys.stderr)
                return 2
            except FailedPrecondition as err:
                # A run whose launcher was killed left its job RUNNING: the scheduler
                # resumed it on start (Scheduler.recover); watch that.
                if scheduler.get(job_id).phase not in ("PENDING", "RUNNING"):
                    print(f"error: {err}", file=sys.stderr)
                    return 2
        else:
            scheduler.submit(spec.model_dump_json(), job_id=job_id, run_dir=str(run_dir))
        print(f"job {job_id}: run directory {run_dir}", flush=True)
        print(f"REST API {api} (bearer token in {token_file})", flush=True)
        progress = _Progress(spec.trainer.num_steps)
        # One client for the whole run: each bare httpx.get builds a new client and
        # with it a TLS context (CA bundle parsed), ~0.3 s of CPU a poll, which the
        # profile showed taking a third of a core from the job it watches.
        with httpx.Client(headers=headers, timeout=10) as client:
            failures = 0
            while True:
                reply = client.get(f"{api}/v1/jobs/{job_id}")
                if reply.status_code != 200:
                    # A busy machine can make the scheduler miss a deadline (503):
                    # the job runs on; only a lasting failure ends the watch.
                    failures += 1
                    if failures >= MAX_STATUS_FAILURES:
                        raise RuntimeError(f"GET /v1/jobs/{job_id}: {reply.status_code} "
                                           f"{reply.text[:300]}")
                    time.sleep(1.0)
                    continue
                failures = 0
                job = reply.json()
                progress.show(job)
                if job["phase"] in TERMINAL:
                    break
                time.sleep(1.0)
        progress.close()
        phase, reason = job["phase"], job["reason"]
        if reason:
            print(f"job {job_id} {phase}: {reason}", flush=True)
    except KeyboardInterrupt:
        print("\ninterrupted: stopping the job and every process it started", flush=True)
        phase = "STOPPED"
        if scheduler is not None:
            # Stopped by its user, so recorded STOPPED (and resumable), not handed
            # over as the scheduler's own SIGTERM would leave it.
            try:
                scheduler.stop(job_id)
            except Exception as err:  # noqa: BLE001 - the scheduler's SIGTERM still saves it
                print(f"job {job_id}: not stopped through the scheduler ({err}); it is "
                      "handed over at the scheduler's shutdown instead", flush=True)
    finally:
        # The API, then the scheduler, each alone first: the scheduler stops its job
        # in order (the trainer checkpoints the step it reached, the buffer goes
        # last) before anything left is taken down; the sandbox, which the job's
        # rollout calls until it stops, after them.
        for proc in reversed(started):
            procs.stop_gracefully(proc, timeout_s=STOP_GRACE_S)
        if sandbox is not None:
            sandbox.stop(timeout_s=STOP_GRACE_S)
        if redis is not None:
            redis.stop()
        _reap_leftovers()

    records = read_metrics(run_dir / "metrics.jsonl")
    summary = {"job_id": job_id, "phase": phase, "reason": reason, **summarize(records)}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    if records:
        plot(records, run_dir / "report.png", title=f"{spec.name} ({phase.lower()})")
    print(json.dumps(summary, indent=2))
    return 0 if phase == "SUCCEEDED" else 1


def wait_http(url: str, timeout_s: float) -> None:
    import httpx

    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=2) as client:  # one TLS context, not one per poll
        while time.monotonic() < deadline:
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer within {timeout_s:.0f}s")


def _reap_leftovers() -> None:
    """Whatever still descends from this process after shutdown is killed."""
    import psutil

    me = psutil.Process(os.getpid())
    for child in me.children(recursive=True):
        try:
            child.kill()
        except psutil.NoSuchProcess:
            pass
