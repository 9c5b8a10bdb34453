"""The sandbox's executor, pool and service on their own: a program's stdout,
stderr, stdin, files and exit code, each limit and the status it ends in, the
clamping of limits, the settings. Hostile programs are tests/integration/
test_sandbox_hostile.py's."""

from __future__ import annotations

import os
import shutil
import signal
import threading

import pytest

from reflow.core.errors import ResourceExhausted, Unavailable
from reflow.sandbox import runner
from reflow.sandbox.executor import build_command, classify, cover_args, namespace_args
from reflow.sandbox.metrics import SandboxMetrics
from reflow.sandbox.service import SandboxService, SandboxSettings
from reflow.sandbox.types import (ERROR, MEMORY, OK, OUTPUT_LIMIT, TIMEOUT, ExecLimits,
                                  ExecRequest)

needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None,
                                 reason="bubblewrap not installed (apt-get install bubblewrap)")


@pytest.fixture(scope="module")
def service():
    svc = SandboxService(SandboxSettings(pool_size=2, max_concurrent=2, max_wall_s=20.0))
    yield svc
    svc.close()


def run(service, code: str, **kwargs):
    limits = kwargs.pop("limits", {})
    return service.execute(ExecRequest(code, limits=ExecLimits(**limits), **kwargs))


@needs_bwrap
def test_stdout_stderr_and_exit_zero(service):
    result = run(service, "import sys\nprint('out')\nprint('err', file=sys.stderr)")
    assert (result.status, result.exit_code) == (OK, 0)
    assert (result.stdout, result.stderr) == ("out\n", "err\n")
    assert not result.truncated
    assert result.wall_s > 0


@needs_bwrap
def test_stdin_reaches_the_program(service):
    result = run(service, "import sys\nname = input()\nrest = sys.stdin.read()\n"
                          "print(name.upper(), len(rest.splitlines()))",
                 stdin="ada\n" + "line\n" * 1000)
    assert result.stdout == "ADA 1000\n"


@needs_bwrap
def test_files_land_in_the_scratch_directory_which_is_the_cwd(service):
    code = ("import os, helper\n"
            "print(helper.answer(), open('data/in.txt').read(), sorted(os.listdir('.')))\n"
            "open('out.txt', 'w').write('written')\n"
            "print(os.path.realpath(os.getcwd()) == os.path.realpath(os.environ['HOME']))")
    result = run(service, code, files={"helper.py": "def answer():\n    return 42\n",
                                       "data/in.txt": "hello"})
    assert result.status == OK, result.stderr
    assert result.stdout == "42 hello ['data', 'helper.py', 'main.py']\nTrue\n"


@needs_bwrap
def test_program_runs_as_main_with_its_own_name(service):
    result = run(service, "import sys\nprint(__name__, __file__, sys.argv)\n"
                          "if __name__ == '__main__':\n    print('main')")
    assert result.stdout == "__main__ main.py ['main.py']\nmain\n"


@needs_bwrap
@pytest.mark.parametrize("code, status, exit_code", [
    ("import sys; sys.exit(3)", ERROR, 3),
    ("import sys; sys.exit(0)", OK, 0),
    ("import sys; sys.exit('bye')", ERROR, 1),
    ("raise SystemExit", OK, 0),
    ("import os; os._exit(7)", ERROR, 7),
    ("import os, signal; os.kill(os.getpid(), signal.SIGTERM)", ERROR, -signal.SIGTERM),
])
def test_exit_codes(service, code, status, exit_code):
    result = run(service, code)
    assert (result.status, result.exit_code) == (status, exit_code)


@needs_bwrap
def test_exception_prints_the_traceback_of_the_program_only(service):
    result = run(service, "def f():\n    return 1 / 0\n\nf()\n")
    assert (result.status, result.exit_code) == (ERROR, 1)
    assert result.stderr.startswith("Traceback (most recent call last):\n  File \"main.py\"")
    assert "return 1 / 0" in result.stderr and "ZeroDivisionError" in result.stderr
    assert "runner" not in result.stderr


@needs_bwrap
def test_syntax_error_is_an_error(service):
    result = run(service, "print(1 +")
    assert result.status == ERROR
    assert "SyntaxError" in result.stderr and "main.py" in result.stderr


@needs_bwrap
def test_wall_clock_limit(service):
    result = run(service, "import time\nprint('start', flush=True)\ntime.sleep(30)",
                 limits={"wall_s": 0.5})
    assert result.status == TIMEOUT
    assert result.stdout == "start\n"  # what it wrote before is kept
    assert 0.5 <= result.wall_s < 30  # killed, not left to finish its sleep


@needs_bwrap
def test_cpu_limit(service):
    result = run(service, "while True:\n    pass", limits={"cpu_s": 0.5, "wall_s": 15.0})
    assert result.status == TIMEOUT
    # The CPU budget's signal ended it, not the wall clock's kill.
    assert result.exit_code == -signal.SIGPROF


@needs_bwrap
def test_memory_limit(service):
    result = run(service, "x = bytearray(400 * 2**20)\nprint('allocated')",
                 limits={"memory_bytes": 128 * 2**20})
    assert result.status == MEMORY
    assert "MemoryError" in result.stderr and "allocated" not in result.stdout


@needs_bwrap
def test_memory_within_the_limit_is_fine(service):
    result = run(service, "x = bytearray(100 * 2**20)\nprint(len(x))",
                 limits={"memory_bytes": 256 * 2**20})
    assert (result.status, result.stdout) == (OK, f"{100 * 2**20}\n")


@needs_bwrap
def test_process_limit_counts_processes_and_threads(service):
    code = ("import os, threading, time\n"
            "n = 0\n"
            "while n < 50:\n"
            "    try:\n"
            "        pid = os.fork()\n"
            "    except OSError:\n"
            "        break\n"
            "    if pid == 0:\n"
            "        time.sleep(60)\n"
            "        os._exit(0)\n"
            "    n += 1\n"
            "print(n)\n")
    result = run(service, code, limits={"max_processes": 4})
    assert (result.status, result.stdout) == (OK, "4\n")
    # Its children were killed with it: it ended well before their sleep did.
    assert result.wall_s < 30
    threads = ("import threading, time\nstarted = 0\n"
               "for _ in range(20):\n"
               "    try:\n"
               "        threading.Thread(target=time.sleep, args=(1,), daemon=True).start()\n"
               "    except RuntimeError:\n"
               "        break\n"
               "    started += 1\n"
               "print(started)\n")
    assert run(service, threads, limits={"max_processes": 3}).stdout == "3\n"


@needs_bwrap
def test_file_size_limit(service):
    code = ("try:\n"
            "    open('big', 'wb').write(b'x' * 2**21)\n"
            "except OSError as e:\n"
            "    print('refused', e.errno)\n"
            "    raise\n")
    result = run(service, code, limits={"max_file_bytes": 2**20})
    assert result.status == ERROR
    assert result.stdout == "refused 27\n"  # EFBIG


@needs_bwrap
def test_output_limit_cuts_and_kills(service):
    result = run(service, "import sys\nwhile True:\n    sys.stdout.write('x' * 4096)",
                 limits={"max_output_bytes": 10_000})
    assert result.status == OUTPUT_LIMIT and result.truncated
    assert result.stdout == "x" * 10_000


@needs_bwrap
def test_output_at_the_limit_is_not_truncated(service):
    result = run(service, "print('y' * 2047)", limits={"max_output_bytes": 2048})
    assert (result.status, result.truncated, len(result.stdout)) == (OK, False, 2048)


@needs_bwrap
def test_environment_is_scrubbed(service):
    result = run(service, "import os\nprint(sorted(os.environ))")
    names = eval(result.stdout)  # noqa: S307 - our own program's repr of a list of names
    assert "REFLOW_GRPC_CREDENTIAL" not in names  # set by tests/conftest.py
    assert set(names) <= {"PATH", "HOME", "TMPDIR", "LANG", "PYTHONDONTWRITEBYTECODE", "PWD",
                          "OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS",
                          "MALLOC_ARENA_MAX", "LC_CTYPE"}


@needs_bwrap
def test_site_packages_are_importable_read_only(service):
    pytest.importorskip("numpy")
    result = run(service, "import numpy\nprint(int(numpy.arange(4).sum()))\n"
                          "import os\nprint(os.access(numpy.__file__, os.W_OK))")
    assert (result.status, result.stdout) == (OK, "6\nFalse\n")


@needs_bwrap
def test_limits_are_clamped_to_the_service_maxima():
    svc = SandboxService(SandboxSettings(pool_size=0, max_wall_s=0.5, max_output_bytes=4096))
    try:
        result = svc.execute(ExecRequest("import time\ntime.sleep(30)",
                                         limits=ExecLimits(wall_s=100.0)))
        assert result.status == TIMEOUT and result.wall_s < 30  # 0.5 s, not 100
        clamped = svc.clamp(ExecLimits(wall_s=100.0, max_output_bytes=2**20, cpu_s=0.25))
        assert (clamped.wall_s, clamped.max_output_bytes, clamped.cpu_s) == (0.5, 4096, 0.25)
        assert svc.stats().cold_starts_total == 1  # pool_size 0: every execution starts one
    finally:
        svc.close()


@needs_bwrap
def test_invalid_request_is_a_value_error_naming_the_field(service):
    before = service.stats().rejected_total
    with pytest.raises(ValueError, match="files"):
        service.execute(ExecRequest("print(1)", files={"../escape.py": ""}))
    assert service.stats().rejected_total == before + 1


@needs_bwrap
def test_concurrent_callers_and_counters():
    metrics = SandboxMetrics()
    svc = SandboxService(SandboxSettings(pool_size=2, max_concurrent=2), metrics=metrics)
    results = []

    def call(i: int) -> None:
        results.append(svc.execute(ExecRequest(f"print({i} * 2)")))

    try:
        threads = [threading.Thread(target=call, args=(i,)) for i in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(int(r.stdout) for r in results) == [2 * i for i in range(8)]
        stats = svc.stats()
        assert stats.executions_total[OK] == 8 and stats.running == 0 and stats.queued == 0
        value = metrics.registry.get_sample_value
        assert value("reflow_sandbox_executions_total", {"status": OK}) == 8
        assert value("reflow_sandbox_execution_seconds_count") == 8
        assert value("reflow_sandbox_queue_depth") == 0
    finally:
        svc.close()


@needs_bwrap
def test_full_queue_is_resource_exhausted():
    svc = SandboxService(SandboxSettings(pool_size=1, max_concurrent=1, max_queued=0))
    try:
        blocker = threading.Thread(target=svc.execute,
                                   args=(ExecRequest("import time; time.sleep(1)"),))
        blocker.start()
        for _ in range(1000):
            if svc.stats().running:
                break
            threading.Event().wait(0.01)
        with pytest.raises(ResourceExhausted, match="max_queued"):
            svc.execute(ExecRequest("print(1)"))
        blocker.join()
    finally:
        svc.close()


@needs_bwrap
@pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"),
                    reason="a root service running bubblewrap as nobody, with an interpreter "
                    "nobody can read")
def test_unprivileged_bubblewrap_as_a_non_root_service_runs_it():
    """The path of a service that is not root (the chart's): bubblewrap in a user
    namespace of its own, no runner dropping anything."""
    svc = SandboxService(SandboxSettings(pool_size=1, privileged=False,
                                         python="/usr/bin/python3"))
    try:
        assert "--unshare-user" in svc.executor.argv
        code = ("import os, socket\n"
                "print(os.getuid())\n"
                "n = 0\n"
                "while n < 50:\n"
                "    try:\n"
                "        if os.fork() == 0:\n"
                "            import time; time.sleep(5); os._exit(0)\n"
                "    except OSError:\n"
                "        break\n"
                "    n += 1\n"
                "print(n)\n"
                "try:\n"
                "    socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
                "except OSError as e:\n"
                "    print(type(e).__name__)\n")
        result = svc.execute(ExecRequest(code, limits=ExecLimits(max_processes=3)))
        assert (result.status, result.stdout) == (OK, "65534\n3\nOSError\n"), result.stderr
    finally:
        svc.close()


@needs_bwrap
def test_closed_service_refuses_and_ends_its_pool():
    svc = SandboxService(SandboxSettings(pool_size=2))
    svc.close()
    with pytest.raises(Unavailable, match="closed"):
        svc.execute(ExecRequest("print(1)"))
    assert svc.stats().warm_processes == 0
    svc.close()  # twice is fine


def test_missing_bwrap_says_how_to_install_it():
    with pytest.raises(RuntimeError, match="apt-get install bubblewrap"):
        SandboxService(SandboxSettings(bwrap="/nonexistent/bwrap"))


def test_settings_from_env(tmp_path):
    tls = tmp_path / "tls"
    env = {"REFLOW_SANDBOX_POOL_SIZE": "7", "REFLOW_SANDBOX_MAX_WALL_S": "2.5",
           "REFLOW_SANDBOX_SECRET_PATHS": "/a:/b", "REFLOW_SANDBOX_PRIVILEGED": "auto",
           "REFLOW_SANDBOX_ADDRESS": "ignored:1", "REFLOW_SECRET_PATHS": str(tmp_path / "x"),
           "REFLOW_TLS_DIR": str(tls), "SOME_TOKEN_FILE": "/etc/token", "UNRELATED": "1"}
    settings = SandboxSettings.from_env(env)
    assert (settings.pool_size, settings.max_wall_s, settings.privileged) == (7, 2.5, None)
    assert {"/a", "/b", str(tmp_path / "x"), str(tls), "/etc/token",
            "/var/run/secrets"} <= set(settings.secret_paths)
    with pytest.raises(ValueError, match="REFLOW_SANDBOX_POOL_SIZ"):
        SandboxSettings.from_env({"REFLOW_SANDBOX_POOL_SIZ": "3"})
    with pytest.raises(ValueError, match="pool_size"):
        SandboxSettings.from_env({"REFLOW_SANDBOX_POOL_SIZE": "-1"})
    with pytest.raises(ValueError, match="absolute"):
        SandboxSettings(readable_paths=["relative/dir"])


def test_classify_exit_codes():
    assert classify(0) == (OK, 0)
    assert classify(runner.EXIT_MEMORY) == (MEMORY, 1)
    assert classify(128 + signal.SIGPROF) == (TIMEOUT, -signal.SIGPROF)
    assert classify(128 + signal.SIGXCPU) == (TIMEOUT, -signal.SIGXCPU)
    assert classify(128 + signal.SIGKILL) == (MEMORY, -signal.SIGKILL)
    assert classify(128 + signal.SIGSEGV) == (ERROR, -signal.SIGSEGV)
    assert classify(2) == (ERROR, 2)


def test_secret_paths_are_covered_inside_the_view_only(tmp_path):
    data = tmp_path / "data"
    (data / "tls").mkdir(parents=True)
    (data / "token").write_text("t")
    args = cover_args([str(data / "token"), str(data / "tls"), "/nowhere/else",
                       str(tmp_path / "outside")], visible=["/usr", str(data)], needed=["/usr"])
    assert args == ["--perms", "0555", "--size", "4096", "--tmpfs", str(data / "tls"),
                    "--remount-ro", str(data / "tls"),
                    "--ro-bind", "/dev/null", str(data / "token")]
    with pytest.raises(RuntimeError, match="every sandbox needs"):
        cover_args([str(tmp_path)], visible=[str(data)], needed=[str(data)])


def test_command_shows_the_interpreter_and_the_runner_only(tmp_path):
    argv = build_command("bwrap", "/opt/venv/bin/python", ["/opt/venv", "/opt/py"],
                         [str(tmp_path)], [], 2**20, privileged=True)
    binds = [argv[i + 1] for i, a in enumerate(argv) if a == "--ro-bind"]
    assert "/" not in binds and "/opt/venv" not in binds  # absent on this machine
    assert str(tmp_path) in binds and "/usr" in binds
    assert argv[-4:] == ["/opt/venv/bin/python", "-I", "-B", "/.sandbox/runner.py"]
    assert "--unshare-net" in argv and "CAP_SETUID" in argv
    unprivileged = build_command("bwrap", "/usr/bin/python3", [], [], [], 2**20,
                                 privileged=False)
    assert "--unshare-user" in unprivileged and "CAP_SETUID" not in unprivileged


def test_namespaces_share_the_network_only_when_asked():
    # An isolated agent (reflow.sandbox.isolate) keeps it, to call its endpoint on loopback.
    assert "--unshare-net" in namespace_args(True)
    assert "--unshare-net" not in namespace_args(True, share_net=True)
    assert "--share-net" in namespace_args(False, share_net=True)
    assert "--share-net" not in namespace_args(False)
