"""The sandbox service over real gRPC on loopback, a real `SandboxService` (and so
real bubblewrap) behind it: who may call it, what a malformed request gets,
callers at once, and the process `reflow run` starts for a task that needs one
(its TLS role, the run's secret paths, its metrics)."""

from __future__ import annotations

import json
import shutil
import tempfile
import threading
import urllib.request
from pathlib import Path

import grpc
import pytest

from reflow import capabilities, launcher, procs, rpcauth, tlscerts
from reflow.core.config import JobSpec
from reflow.core.errors import InvalidArgument
from reflow.core.grants import JOB_TOKENS
from reflow.sandbox.grpc_client import GrpcSandboxClient
from reflow.sandbox.server import serve
from reflow.sandbox.service import SandboxService, SandboxSettings
from reflow.sandbox.types import ERROR, MAX_CODE_BYTES, OK, TIMEOUT, ExecLimits, ExecRequest
from reflow.v1 import sandbox_pb2

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="needs bubblewrap (make system-deps)")

JOB = "job-sandbox"
EXECUTE = "/reflow.v1.Sandbox/Execute"
GET_STATS = "/reflow.v1.Sandbox/GetStats"


def _pass(role: str, job_id: str = JOB) -> str:
    """A job pass as the scheduler hands one to a worker of `role` (this process
    holds the scheduler's key: tests/conftest.py)."""
    return capabilities.issue_pass(_scheduler_key, job_id, role)


_scheduler_key = rpcauth.credentials().signing["scheduler"]


@pytest.fixture(scope="module")
def sandbox():
    service = SandboxService(SandboxSettings(pool_size=2, max_concurrent=4))
    server, port = serve(service, "127.0.0.1:0")
    yield f"127.0.0.1:{port}", service
    server.stop(0)
    service.close()


@pytest.fixture
def as_rollout(monkeypatch):
    """This process as a rollout worker: no signing key (its calls carry its job
    pass, never the scheduler's capability) and its rollout pass for JOB in its
    book, as the scheduler's StartJob leaves it."""
    for env in rpcauth.SIGNING_KEY_ENVS.values():
        monkeypatch.delenv(env, raising=False)
        monkeypatch.delenv(f"{env}_FILE", raising=False)
    rpcauth.reset_credentials()
    assert not rpcauth.credentials().signing
    JOB_TOKENS.grant(JOB, _pass("rollout"))
    yield
    JOB_TOKENS.revoke(JOB)
    rpcauth.reset_credentials()  # read again once monkeypatch has put the keys back


def _raw_call(address: str, method: str, request, metadata) -> grpc.StatusCode:
    """The call's status, over a plain channel carrying exactly `metadata`."""
    reply = sandbox_pb2.SandboxStats if method == GET_STATS else sandbox_pb2.ExecuteReply
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(method, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=reply.FromString)
        try:
            call(request, metadata=metadata, timeout=30)
        except grpc.RpcError as err:
            return err.code()
    return grpc.StatusCode.OK


def test_a_rollout_pass_runs_programs_and_gets_what_came_of_them(sandbox, as_rollout):
    address, _ = sandbox
    client = GrpcSandboxClient(address)
    try:
        result = client.execute(ExecRequest(
            code="import sys\nprint(open('data.txt').read() + sys.stdin.read())",
            stdin="!", files={"data.txt": "hello"}), job_id=JOB)
        assert (result.status, result.exit_code, result.stdout) == (OK, 0, "hello!\n")
        # A program that fails or overruns is a reply, not an error.
        failed = client.execute(ExecRequest("raise SystemExit(3)"), job_id=JOB)
        assert (failed.status, failed.exit_code) == (ERROR, 3)
        raised = client.execute(ExecRequest("1 / 0"), job_id=JOB)
        assert raised.status == ERROR and "ZeroDivisionError" in raised.stderr
        slow = client.execute(ExecRequest("while True: pass",
                                          limits=ExecLimits(wall_s=0.5, cpu_s=0.5)), job_id=JOB)
        assert slow.status == TIMEOUT
    finally:
        client.close()


def test_calls_without_the_credential_or_a_rollout_pass_of_the_job_are_refused(sandbox):
    address, _ = sandbox
    credential = (rpcauth.CREDENTIAL_KEY, rpcauth.credentials().credential)
    request = sandbox_pb2.ExecuteRequest(job_id=JOB, code="print(1)")
    refused = {
        "no credential": ([], grpc.StatusCode.UNAUTHENTICATED),
        "a wrong credential": ([(rpcauth.CREDENTIAL_KEY, "not-the-credential-0123456789")],
                               grpc.StatusCode.UNAUTHENTICATED),
        "no pass": ([credential], grpc.StatusCode.PERMISSION_DENIED),
        "a trainer's pass": ([credential, (rpcauth.JOB_TOKEN_KEY, _pass("trainer"))],
                             grpc.StatusCode.PERMISSION_DENIED),
        "another job's rollout pass": ([credential, (rpcauth.JOB_TOKEN_KEY,
                                                     _pass("rollout", "job-other"))],
                                       grpc.StatusCode.PERMISSION_DENIED),
        "a pass signed by another key": ([credential, (rpcauth.JOB_TOKEN_KEY,
                                                       capabilities.issue_pass(
                                                           capabilities.new_private_key(),
                                                           JOB, "rollout"))],
                                         grpc.StatusCode.PERMISSION_DENIED),
    }
    wrong = {what: code for what, (metadata, expected) in refused.items()
             if (code := _raw_call(address, EXECUTE, request, metadata)) != expected}
    assert not wrong, wrong
    # Any job's rollout pass is taken (the sandbox keeps no grants), and only that.
    rollout = [credential, (rpcauth.JOB_TOKEN_KEY, _pass("rollout", "job-never-granted"))]
    assert _raw_call(address, EXECUTE, sandbox_pb2.ExecuteRequest(
        job_id="job-never-granted", code="print(1)"), rollout) == grpc.StatusCode.OK
    # The counters name no job: the scheduler's capability, not a worker's pass.
    stats = sandbox_pb2.SandboxStatsRequest()
    assert _raw_call(address, GET_STATS, stats, rollout) == grpc.StatusCode.PERMISSION_DENIED
    capability = (rpcauth.CAPABILITY_KEY, capabilities.mint(
        _scheduler_key, "scheduler", GET_STATS, address, "", stats.SerializeToString()))
    assert _raw_call(address, GET_STATS, stats, [credential, capability]) == grpc.StatusCode.OK


def test_the_client_of_a_worker_holding_a_trainer_pass_is_denied(sandbox, as_rollout):
    address, _ = sandbox
    JOB_TOKENS.grant(JOB, _pass("trainer"))
    client = GrpcSandboxClient(address)
    try:
        with pytest.raises(grpc.RpcError) as refused:
            client.execute(ExecRequest("print(1)"), job_id=JOB)
        assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "rollout only" in refused.value.details()
    finally:
        client.close()


def test_a_malformed_request_is_invalid_argument_naming_the_field(sandbox, as_rollout):
    address, service = sandbox
    rejected = service.stats().rejected_total
    client = GrpcSandboxClient(address)
    try:
        with pytest.raises(InvalidArgument, match=r"^files: '\.\./escape\.py' is not a relative"):
            client.execute(ExecRequest("print(1)", files={"../escape.py": "x"}), job_id=JOB)
        with pytest.raises(InvalidArgument, match=rf"^code: .* more than {MAX_CODE_BYTES}"):
            client.execute(ExecRequest("#" * (MAX_CODE_BYTES + 1)), job_id=JOB)
        with pytest.raises(ValueError, match="^job_id: "):  # refused before it is sent
            client.execute(ExecRequest("print(1)"))
    finally:
        client.close()
    assert service.stats().rejected_total == rejected + 2
    # Limits out of range, as another client could send them.
    credential = (rpcauth.CREDENTIAL_KEY, rpcauth.credentials().credential)
    request = sandbox_pb2.ExecuteRequest(job_id=JOB, code="print(1)",
                                         limits=sandbox_pb2.ExecLimits(wall_s=-1))
    with grpc.insecure_channel(address) as channel:
        call = channel.unary_unary(EXECUTE, request_serializer=lambda m: m.SerializeToString(),
                                   response_deserializer=sandbox_pb2.ExecuteReply.FromString)
        with pytest.raises(grpc.RpcError) as refused:
            call(request, metadata=[credential, (rpcauth.JOB_TOKEN_KEY, _pass("rollout"))],
                 timeout=30)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.value.details().startswith("limits.wall_s: Input should be greater than 0")


def test_callers_at_once_each_get_their_own_result(sandbox, as_rollout):
    address, service = sandbox
    clients = [GrpcSandboxClient(address) for _ in range(2)]  # two channels, as two workers
    n = 6
    start = threading.Barrier(n)
    results: dict[int, object] = {}

    def call(i: int) -> None:
        start.wait()
        code = f"import sys, time\ntime.sleep(0.2)\nprint({i} * 1000 + int(sys.stdin.read()))"
        results[i] = clients[i % 2].execute(ExecRequest(code, stdin=str(i)), job_id=JOB)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(n)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
    finally:
        for client in clients:
            client.close()
    assert {i: (r.status, r.stdout) for i, r in results.items()} == {
        i: (OK, f"{i * 1000 + i}\n") for i in range(n)}
    assert service.stats().running == 0


def test_needs_sandbox_reads_the_task_class(monkeypatch):
    from reflow.core import plugins

    spec = JobSpec.model_validate({"model": {"path": "/models/tiny"}})
    assert launcher.needs_sandbox(spec) is False  # the default task runs no code

    class CodeTask:
        needs_sandbox = True

    monkeypatch.setattr(plugins, "resolve", lambda kind, name, field=None: CodeTask)
    assert launcher.needs_sandbox(spec) is True


def test_the_sandbox_reflow_run_starts_hides_the_runs_secrets_and_serves_metrics(
        tmp_path, monkeypatch, request):
    """What `reflow run` starts for a task with needs_sandbox: `reflow serve sandbox`
    with the sandbox role's TLS certificate, the run's secret paths and a metrics
    port in endpoints.json and prometheus-targets.json."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    # This process: a rollout worker of a run under TLS (the launcher's directory of
    # per-role certificates, its own the rollout role's).
    tls = tlscerts.mint(tmp_path / "tls")
    for env, value in {tlscerts.TLS_ENV: "on", tlscerts.TLS_DIR_ENV: str(tls),
                       tlscerts.TLS_CERT_ENV: str(tls / "rollout.crt"),
                       tlscerts.TLS_KEY_ENV: str(tls / "rollout.key"),
                       tlscerts.TLS_CA_ENV: str(tls / tlscerts.CA_FILE)}.items():
        monkeypatch.setenv(env, value)
    monkeypatch.delenv(tlscerts.TLS_SERVER_NAME_ENV, raising=False)
    # A directory programs may read, holding a file the run lists as secret; not
    # under /tmp, which in a sandbox is the program's own scratch directory.
    data = Path(tempfile.mkdtemp(prefix="reflow-sandbox-test-", dir="/var/tmp"))  # nosec B108
    request.addfinalizer(lambda: shutil.rmtree(data, ignore_errors=True))
    data.chmod(0o755)
    (data / "public.txt").write_text("public")
    (data / "token.txt").write_text("hunter2")
    env = {"REFLOW_SECRET_PATHS": str(data / "token.txt"),
           "REFLOW_SANDBOX_READABLE_PATHS": str(data), "REFLOW_SANDBOX_POOL_SIZE": "1"}

    sandbox = launcher.SandboxProcess(run_dir, env)
    proc, address = sandbox.proc, sandbox.address
    try:
        sandbox.wait()
        endpoints = json.loads((run_dir / "endpoints.json").read_text())
        assert endpoints["sandbox"]["grpc"] == address
        targets = json.loads((run_dir / "prometheus-targets.json").read_text())
        assert {"targets": [endpoints["sandbox"]["metrics"]],
                "labels": {"service": "sandbox"}} in targets

        for name in rpcauth.SIGNING_KEY_ENVS.values():
            monkeypatch.delenv(name, raising=False)
        rpcauth.reset_credentials()
        JOB_TOKENS.grant(JOB, _pass("rollout"))
        client = GrpcSandboxClient(address)
        try:
            result = client.execute(ExecRequest(
                f"try:\n    secret = open({str(data / 'token.txt')!r}).read()\n"
                f"except OSError as err:\n    secret = type(err).__name__\n"
                f"print(open({str(data / 'public.txt')!r}).read(), repr(secret))"), job_id=JOB)
        finally:
            client.close()
        assert result.status == OK, result.stderr
        assert result.stdout.startswith("public ") and "hunter2" not in result.stdout

        with urllib.request.urlopen(f"http://{endpoints['sandbox']['metrics']}/metrics",
                                    timeout=10) as reply:
            text = reply.read().decode()
        assert 'reflow_sandbox_executions_total{status="ok"} 1.0' in text
    finally:
        JOB_TOKENS.revoke(JOB)
        rpcauth.reset_credentials()
        procs.stop_gracefully(proc, timeout_s=15)
    assert proc.returncode == 0, (run_dir / "logs" / "sandbox.log").read_text()[-2000:]


def test_a_sandbox_that_cannot_start_says_why_at_once(tmp_path):
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    sandbox = launcher.SandboxProcess(run_dir, {"REFLOW_SANDBOX_BWRAP": "/nonexistent/bwrap"})
    try:
        with pytest.raises(RuntimeError, match=r"exited \(1\) before it served: .*bubblewrap "
                                                r"'/nonexistent/bwrap' not found"):
            sandbox.wait(timeout_s=60)
    finally:
        sandbox.stop(timeout_s=5)


def test_a_sandbox_killed_mid_job_comes_back_and_the_call_in_its_gap_is_answered(
        tmp_path, monkeypatch):
    """kill -9 of the run's sandbox: its supervisor starts it again on the same
    port, and a call sent while it was down is answered by the restart (the
    client's retries), as the episodes of a running job are."""
    run_dir = tmp_path / "run"
    (run_dir / "logs").mkdir(parents=True)
    sandbox = launcher.SandboxProcess(run_dir, {"REFLOW_SANDBOX_POOL_SIZE": "1"})
    sandbox.wait()
    sandbox.supervise(poll_s=0.1)
    for name in rpcauth.SIGNING_KEY_ENVS.values():
        monkeypatch.delenv(name, raising=False)
    rpcauth.reset_credentials()
    JOB_TOKENS.grant(JOB, _pass("rollout"))
    client = GrpcSandboxClient(sandbox.address, retry_s=60)
    try:
        assert client.execute(ExecRequest("print('before')"), job_id=JOB).stdout == "before\n"
        first = sandbox.proc
        first.kill()
        first.wait()
        # Sent into the gap: refused UNAVAILABLE until the restart serves it.
        result = client.execute(ExecRequest("print('after')"), job_id=JOB)
        assert (result.status, result.stdout) == (OK, "after\n")
        assert sandbox.restarts == 1 and sandbox.proc is not first
    finally:
        client.close()
        JOB_TOKENS.revoke(JOB)
        rpcauth.reset_credentials()
        sandbox.stop(timeout_s=15)
    assert sandbox.proc.returncode == 0


def test_a_task_s_environment_reaches_the_sandbox_over_grpc_with_the_worker_s_pass(
        sandbox, as_rollout, tmp_path, monkeypatch):
    """What a rollout worker does in a job: the task is built with its job id
    (TaskContext.job_id), its environment takes the process's sandbox client from
    REFLOW_SANDBOX_ADDRESS, and each code run names the job with the worker's
    rollout pass from its book."""
    from reflow.sandbox import client as sandbox_client
    from reflow.tasks import TaskContext
    from reflow.tasks.python_tool import PythonToolTask

    address, service = sandbox
    (tmp_path / "sums.jsonl").write_text(json.dumps({"question": "What is 6 * 7?",
                                                     "answer": "42"}) + "\n")
    monkeypatch.setenv(sandbox_client.ADDRESS_ENV, address)
    previous = sandbox_client.set_default_client(None)
    before = sum(service.stats().executions_total.values())
    try:
        task = PythonToolTask(context=TaskContext(datasets_root=tmp_path, job_id=JOB),
                              path="sums.jsonl", eval_fraction=0.0)
        env = task.environment(next(task.prompts()))
        env.reset()
        ran = env.step("Let me compute.\n```python\nprint(6 * 7, 'from', __name__)\n```")
        assert isinstance(sandbox_client.default_client(), GrpcSandboxClient)
        assert "42 from __main__" in ran.observation and ran.tool_calls == 1
        assert ran.info["status"] == OK and not ran.done
        done = env.step("The answer is \\boxed{42}.")
        assert done.done and done.reward == 1.0
        assert sum(service.stats().executions_total.values()) == before + 1
        # Without a job id (a task built where none is known) nothing is sent.
        task.context = TaskContext(datasets_root=tmp_path)
        with pytest.raises((ValueError, InvalidArgument), match="job"):
            env.step("```python\nprint(1)\n```")
    finally:
        sandbox_client.default_client().close()
        sandbox_client.set_default_client(previous)
