"""Hostile programs against the sandbox service, through its gRPC server on
loopback (reflow.sandbox.server) with a real `SandboxService` and bubblewrap behind
it. Each case must be contained (its status says how it ended, and nothing of the
host is touched or seen), counted in the service's metrics, and leave the service
healthy: a trivial program runs fine right after."""

from __future__ import annotations

import json
import os
import resource
import shutil
import socket
import threading
import signal
import time
from pathlib import Path

import pytest

from reflow import capabilities, rpcauth
from reflow.core.grants import JOB_TOKENS
from reflow.sandbox.grpc_client import GrpcSandboxClient
from reflow.sandbox.server import serve
from reflow.sandbox.service import SandboxService, SandboxSettings
from reflow.sandbox.types import MEMORY, OK, OUTPUT_LIMIT, TIMEOUT, ExecLimits, ExecRequest

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None,
                                reason="needs bubblewrap (apt-get install bubblewrap)")

JOB = "job-hostile"
REPO = Path(__file__).resolve().parents[2]
SECRET_ENV = "REFLOW_HOSTILE_TEST_TOKEN"
SECRET_VALUE = "hostile-test-secret-5b1c0e"
SECRET_FILE_TEXT = "file-secret-93d7a1"
MODEL_BYTES = b"weights" * 1000
# The name every process of the fork bomb carries (children inherit it).
BOMB_NAME = "rfbomb"


@pytest.fixture(scope="module")
def host(tmp_path_factory):
    """What the host holds: a directory programs may read (`data`) with a secret
    file and a secret TLS directory in it, a model directory inside it and one
    outside, and a secret in the service's environment."""
    root = tmp_path_factory.mktemp("hostile")
    data = root / "data"
    (data / "tls").mkdir(parents=True)
    (data / "tls" / "server.key").write_text(SECRET_FILE_TEXT)
    (data / "credentials.json").write_text(SECRET_FILE_TEXT)
    (data / "notes.txt").write_text("readable")
    (data / "model").mkdir()
    (data / "model" / "weights.bin").write_bytes(MODEL_BYTES)
    (root / "private-model").mkdir()
    (root / "private-model" / "weights.bin").write_bytes(MODEL_BYTES)
    os.chmod(root, 0o755)  # pytest makes its directories 0700; nobody must reach data
    return root


@pytest.fixture(scope="module")
def sandbox(host):
    """(client, service): the service started with a secret in its environment,
    told to hide the secret file and directory; the client as a rollout worker
    holding its pass for JOB."""
    data = host / "data"
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(SECRET_ENV, SECRET_VALUE)
        scheduler_key = rpcauth.credentials().signing["scheduler"]
        service = SandboxService(SandboxSettings(
            pool_size=2, max_concurrent=4, readable_paths=[str(data)],
            secret_paths=[str(data / "credentials.json"), str(data / "tls")]))
        server, port = serve(service, "127.0.0.1:0")
        for env in rpcauth.SIGNING_KEY_ENVS.values():
            mp.delenv(env, raising=False)
            mp.delenv(f"{env}_FILE", raising=False)
        rpcauth.reset_credentials()
        JOB_TOKENS.grant(JOB, capabilities.issue_pass(scheduler_key, JOB, "rollout"))
        client = GrpcSandboxClient(f"127.0.0.1:{port}")
        try:
            yield client, service, port
        finally:
            client.close()
            JOB_TOKENS.revoke(JOB)
            server.stop(0)
            service.close()
    rpcauth.reset_credentials()


def run(sandbox, code: str, **limits):
    client, _, _ = sandbox
    return client.execute(ExecRequest(code, limits=ExecLimits(**limits)), job_id=JOB)


def counted(sandbox, name: str, labels: dict | None = None) -> float:
    return sandbox[1].metrics.registry.get_sample_value(name, labels or {}) or 0.0


def assert_healthy(sandbox) -> None:
    result = run(sandbox, "print('still here')")
    assert (result.status, result.stdout) == (OK, "still here\n")
    assert sandbox[1].stats().running == 0


def _processes_named(name: str) -> int:
    count = 0
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/comm") as f:
                count += f.read().strip() == name
        except OSError:
            continue
    return count


def _processes_running(argument: str) -> list[int]:
    found = []
    for pid in os.listdir("/proc"):
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if argument.encode() in f.read().split(b"\0"):
                    found.append(int(pid))
        except (OSError, ValueError):
            continue
    return found


def test_fork_bomb_is_held_to_its_process_limit(sandbox):
    code = ("import ctypes, os\n"
            f"ctypes.CDLL(None).prctl(15, b'{BOMB_NAME}', 0, 0, 0)\n"  # PR_SET_NAME
            "while True:\n"
            "    try:\n"
            "        os.fork()\n"
            "    except OSError:\n"
            "        pass\n")
    timeouts = counted(sandbox, "reflow_sandbox_timeouts_total")
    done: list = []
    caller = threading.Thread(target=lambda: done.append(run(sandbox, code, wall_s=3.0,
                                                             max_processes=16)))
    caller.start()
    most = 0
    while caller.is_alive():
        most = max(most, _processes_named(BOMB_NAME))
        time.sleep(0.1)
    caller.join()
    assert done[0].status == TIMEOUT
    assert 1 <= most <= 17  # the program and at most max_processes more
    time.sleep(0.5)
    assert _processes_named(BOMB_NAME) == 0  # every one of them ended with the sandbox
    assert counted(sandbox, "reflow_sandbox_timeouts_total") == timeouts + 1
    assert_healthy(sandbox)


def test_processes_left_behind_die_with_the_program(sandbox):
    code = ("import os, subprocess\n"
            "subprocess.Popen(['sleep', '314.159'], start_new_session=True)\n"
            "if os.fork() == 0:\n"
            "    os.setsid()\n"
            "    os.execvp('sleep', ['sleep', '314.159'])\n"
            "print('left them')\n")
    result = run(sandbox, code)
    assert (result.status, result.stdout) == (OK, "left them\n")
    time.sleep(0.5)
    assert not _processes_running("314.159")
    assert_healthy(sandbox)


@pytest.mark.parametrize("code", [
    "x = bytearray(8 * 2**30)",
    "x = [0] * (2**30)",
    "chunks = []\nwhile True:\n    chunks.append(bytearray(64 * 2**20))",
])
def test_huge_allocations_end_in_memory(sandbox, code):
    kills = counted(sandbox, "reflow_sandbox_memory_kills_total")
    result = run(sandbox, code, memory_bytes=512 * 2**20)
    assert result.status == MEMORY and "MemoryError" in result.stderr
    assert counted(sandbox, "reflow_sandbox_memory_kills_total") == kills + 1
    assert counted(sandbox, "reflow_sandbox_executions_total", {"status": MEMORY}) >= kills + 1
    assert_healthy(sandbox)


def test_infinite_loop_is_stopped_by_the_wall_clock(sandbox):
    timeouts = counted(sandbox, "reflow_sandbox_timeouts_total")
    result = run(sandbox, "while True:\n    pass", wall_s=1.0, cpu_s=30.0)
    # The wall clock (1 s) ended it, long before its CPU budget (30 s) could.
    assert result.status == TIMEOUT and 1.0 <= result.wall_s < 30.0
    assert counted(sandbox, "reflow_sandbox_timeouts_total") == timeouts + 1
    assert_healthy(sandbox)


def test_cpu_spin_in_a_thread_is_stopped_by_the_cpu_limit(sandbox):
    code = ("import threading\n"
            "def spin():\n"
            "    while True:\n"
            "        pass\n"
            "threading.Thread(target=spin).start()\n"
            "print('main thread done', flush=True)\n")
    timeouts = counted(sandbox, "reflow_sandbox_timeouts_total")
    result = run(sandbox, code, cpu_s=1.0, wall_s=30.0)
    assert result.status == TIMEOUT and result.stdout == "main thread done\n"
    assert result.exit_code == -signal.SIGPROF  # the CPU budget ended it, not the wall clock
    assert counted(sandbox, "reflow_sandbox_timeouts_total") == timeouts + 1
    assert_healthy(sandbox)


def test_loopback_services_of_the_host_are_out_of_reach(sandbox):
    # Stand-ins for the API, Redis and the trainer listening on the host's loopback,
    # and a UDP one; the sandbox's own gRPC port too.
    listeners = []
    for _ in range(3):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen()
        s.setblocking(False)
        listeners.append(s)
    udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    udp.bind(("127.0.0.1", 0))
    udp.setblocking(False)
    ports = [s.getsockname()[1] for s in listeners] + [sandbox[2]]
    code = ("import json, socket\n"
            f"ports = {ports}\n"
            "out = {}\n"
            "for port in ports + [80]:\n"
            "    for host in ('127.0.0.1', 'localhost', '10.0.0.1', '1.1.1.1'):\n"
            "        try:\n"
            "            socket.create_connection((host, port), timeout=1).close()\n"
            "            out[f'{host}:{port}'] = 'connected'\n"
            "        except OSError as e:\n"
            "            out[f'{host}:{port}'] = type(e).__name__\n"
            "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            f"u.sendto(b'hello', ('127.0.0.1', {udp.getsockname()[1]}))\n"
            "print(json.dumps(out))\n")
    try:
        result = run(sandbox, code, wall_s=20.0)
        assert result.status == OK, result.stderr
        outcomes = json.loads(result.stdout)
        assert outcomes and "connected" not in outcomes.values()
        for s in listeners:
            with pytest.raises(BlockingIOError):
                s.accept()
        with pytest.raises(BlockingIOError):
            udp.recvfrom(16)
    finally:
        for s in [*listeners, udp]:
            s.close()
    assert_healthy(sandbox)


def test_secrets_of_the_service_are_not_visible(sandbox, host):
    data = host / "data"
    code = ("import glob, os\n"
            "print('env', dict(os.environ))\n"
            "for path in sorted(glob.glob('/proc/[0-9]*/environ')) + ['/proc/1/environ']:\n"
            "    try:\n"
            "        print(path, open(path, 'rb').read())\n"
            "    except OSError as e:\n"
            "        print(path, 'refused', e)\n"
            f"print('notes', open('{data}/notes.txt').read())\n"
            f"for path in ['{data}/credentials.json', '{data}/tls/server.key']:\n"
            "    try:\n"
            "        print(path, repr(open(path).read()))\n"
            "    except OSError as e:\n"
            "        print(path, 'refused', type(e).__name__)\n"
            f"print('tls dir', os.listdir('{data}/tls'))\n"
            "print('pids', sorted(int(p) for p in os.listdir('/proc') if p.isdigit()))\n")
    result = run(sandbox, code)
    assert result.status == OK, result.stderr
    out = result.stdout
    assert "notes readable" in out  # the directory is visible: what hides the secrets is the cover
    assert SECRET_VALUE not in out and SECRET_ENV not in out
    assert os.environ["REFLOW_GRPC_CREDENTIAL"] not in out
    assert SECRET_FILE_TEXT not in out
    assert "tls dir []" in out
    pids = json.loads(out.split("pids ")[1].strip())
    assert len(pids) <= 3  # bubblewrap's pid 1 and the program: none of the host's
    assert_healthy(sandbox)


def test_writes_outside_the_scratch_directory_fail(sandbox, host):
    data = host / "data"
    targets = ["/x", "/etc/x", "/usr/x", "/work/x", str(REPO / "x"),
               str(REPO / "services" / "x"), f"{data}/x", f"{data}/notes.txt", "/proc/x",
               "/dev/x", "/.sandbox/runner.py", "/proc/sys/kernel/hostname"]
    code = ("import json, os\n"
            "out = {}\n"
            f"for path in {targets}:\n"
            "    try:\n"
            "        with open(path, 'a') as f:\n"
            "            f.write('pwned')\n"
            "        out[path] = 'written'\n"
            "    except OSError as e:\n"
            "        out[path] = type(e).__name__\n"
            "open('in-scratch.txt', 'w').write('fine')\n"
            "print(json.dumps(out))\n")
    result = run(sandbox, code)
    assert result.status == OK, result.stderr
    assert "written" not in json.loads(result.stdout).values()
    assert not (REPO / "x").exists() and not (data / "x").exists()
    assert (data / "notes.txt").read_text() == "readable"
    assert_healthy(sandbox)


def test_a_shell_runs_inside_the_sandbox_with_its_limits(sandbox, host):
    data = host / "data"
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port = listener.getsockname()[1]
    shell = (f"env; cat {data}/credentials.json; cat /proc/1/environ; "
             "grep -E 'Max (processes|address space)' /proc/self/limits; "
             f"python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", {port}), 1)' "
             "2>/dev/null && echo net=open || echo net=closed")
    code = f"import os\nstatus = os.system({shell!r})\nprint('status', status)\n"
    try:
        result = run(sandbox, code, max_processes=8, memory_bytes=512 * 2**20)
    finally:
        listener.close()
    assert result.status == OK, result.stderr
    out = result.stdout
    assert "net=closed" in out and "status 0" in out
    assert SECRET_VALUE not in out and SECRET_FILE_TEXT not in out
    assert os.environ["REFLOW_GRPC_CREDENTIAL"] not in out
    # The shell and what it runs inherit the program's limits.
    limits = {line.split()[1]: line.split()[3] for line in out.splitlines()
              if line.startswith("Max ")}
    assert limits["address"] == str(512 * 2**20)
    assert int(limits["processes"]) <= 8 + 3  # max_processes, the runner, bubblewrap's pid 1
    assert_healthy(sandbox)


def test_printing_100_mb_is_cut_without_the_service_holding_it(sandbox):
    before_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    code = "import sys\nchunk = 'x' * 2**20\nfor _ in range(100):\n    sys.stdout.write(chunk)\n"
    result = run(sandbox, code, max_output_bytes=2**20)
    assert result.status == OUTPUT_LIMIT and result.truncated
    assert len(result.stdout) == 2**20
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before_kb) / 1024
    assert grown_mb < 48  # the cap and a reply's copies of it, never the 100 MB
    assert counted(sandbox, "reflow_sandbox_executions_total", {"status": OUTPUT_LIMIT}) >= 1
    assert_healthy(sandbox)


def test_model_files_cannot_be_deleted_or_changed(sandbox, host):
    visible = host / "data" / "model"
    private = host / "private-model"
    code = ("import json, os, shutil\n"
            "out = {}\n"
            f"for d in ['{visible}', '{private}']:\n"
            "    w = os.path.join(d, 'weights.bin')\n"
            "    for name, act in [('remove', lambda: os.remove(w)),\n"
            "                      ('truncate', lambda: open(w, 'wb').close()),\n"
            "                      ('rename', lambda: os.rename(w, w + '.old')),\n"
            "                      ('chmod', lambda: os.chmod(w, 0)),\n"
            "                      ('rmtree', lambda: shutil.rmtree(d))]:\n"
            "        try:\n"
            "            act()\n"
            "            out[d + ' ' + name] = 'done'\n"
            "        except OSError as e:\n"
            "            out[d + ' ' + name] = type(e).__name__\n"
            f"print(os.path.getsize('{visible}/weights.bin'))\n"
            "print(json.dumps(out))\n")
    result = run(sandbox, code)
    assert result.status == OK, result.stderr
    size, outcomes = result.stdout.splitlines()
    assert int(size) == len(MODEL_BYTES)  # the visible model is readable
    outcomes = json.loads(outcomes)
    assert "done" not in outcomes.values()
    assert all(v == "FileNotFoundError" for k, v in outcomes.items() if str(private) in k)
    for directory in (visible, private):
        assert (directory / "weights.bin").read_bytes() == MODEL_BYTES
        assert os.stat(directory / "weights.bin").st_mode & 0o777 != 0
    assert_healthy(sandbox)
