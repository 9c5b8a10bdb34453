"""Reward processes start confined (reflow.tasks.confine): a hostile reward finds
no credential of the worker's (in its environment or in the worker's secret
files), cannot reach the network, cannot fork without bound or allocate
without limit, and cannot talk the pool into anything with what it writes on
the protocol pipe. Each such call fails with its own
`reward_error`, and the pool goes on scoring.

The hostile reward is a real plug-in, installed as an operator would
(tests/integration/test_plugin_package.py): reward processes build tasks by
registered name only. Its reward does what the response asks ("env PATH",
"fork", "alloc", "connect PORT", ...), as model-written text might. Real
processes, real namespaces, real limits: nothing of the OS is mocked.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
from pathlib import Path

import pytest

from reflow.rollout.scoring import ErrorWindow
from reflow.tasks import Prompt, TaskContext
from reflow.tasks.confine import (ALWAYS_SECRET, MAX_SECRET_PATHS, PACKAGE_ROOT, RewardLimits,
                                  environment, parse_secret_paths, secret_paths)
from reflow.tasks.rewards import REWARD_ERRORS, RewardPool, RewardResult

MARKER = "s3cr3t-do-not-leak"
SECRETS = {"REFLOW_GRPC_CREDENTIAL": MARKER + "-grpc",
           "REFLOW_CONTROL_CREDENTIAL_SHA256": MARKER + "-sha",
           "REDIS_PASSWORD": MARKER + "-redis",
           "REFLOW_JOB_TOKEN": MARKER + "-job",
           "AWS_SECRET_ACCESS_KEY": MARKER + "-aws",
           "REFLOW_TLS_KEY_FILE": "/etc/" + MARKER + ".key",
           "REFLOW_SCHEDULER_ADDRESS": "10.0.0.1:" + MARKER}
PROMPT = Prompt("p0", "say ok", "ok")

PROBE = '''
"""A task whose reward does what the response asks: a stand-in for hostile
model-written text. Only pydantic is imported at module level."""

import json
import os
import socket
import stat
import time

from pydantic import BaseModel, ConfigDict


class _Prompt:
    def __init__(self, prompt_id, text, answer):
        self.prompt_id, self.text, self.answer = prompt_id, text, answer


def _read(path):
    try:
        with open(path, "rb") as f:
            return f.read().decode("utf-8", "replace")
    except OSError:
        return None


def _protocol_writes(data):
    """Write `data` to every pipe this process may write to, except stdout and
    stderr: one of them is the protocol pipe to the pool."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        try:
            if fd > 2 and stat.S_ISFIFO(os.fstat(fd).st_mode):
                os.write(fd, data)
        except OSError:
            pass  # the read end, or gone


class ProbeTask:
    class Args(BaseModel):
        model_config = ConfigDict(extra="forbid")

    def __init__(self, context=None):
        pass

    def prompts(self):
        while True:
            yield _Prompt("p", "say ok", "ok")

    def eval_prompts(self, num_prompts):
        return [_Prompt(f"e{i}", "say ok", "ok") for i in range(num_prompts)]

    def reward(self, prompt, response_text):
        action, _, arg = response_text.partition(" ")
        if action == "env":
            others = {pid: _read(f"/proc/{pid}/environ") for pid in os.listdir("/proc")
                      if pid.isdigit()}
            seen = {"environ": dict(os.environ), "self": _read("/proc/self/environ"),
                    "others": {pid: text for pid, text in others.items() if text is not None}}
            with open(arg, "w") as f:
                json.dump(seen, f)
            return 1.0 if "s3cr3t" in json.dumps(seen) else 0.0
        if action == "files":
            # Read, list, overwrite and unmount what the worker keeps secret.
            import ctypes

            with open(arg) as f:
                asked = json.load(f)
            libc = ctypes.CDLL(None, use_errno=True)
            seen = {"read": {p: _read(p) for p in asked["read"]}, "list": {}, "write": {},
                    "umount": {}}
            for path in asked["list"]:
                try:
                    seen["list"][path] = sorted(os.listdir(path))
                except OSError as err:
                    seen["list"][path] = err.strerror
            for path in asked["read"]:
                try:
                    with open(path, "w") as f:
                        f.write("overwritten by a reward")
                    seen["write"][path] = "written"
                except OSError as err:
                    seen["write"][path] = err.strerror
            for path in asked["list"] + asked["read"]:
                seen["umount"][path] = libc.umount2(path.encode(), 2) == 0
            seen["after"] = {p: _read(p) for p in asked["read"]}
            with open(asked["out"], "w") as f:
                json.dump(seen, f)
            return 1.0 if "s3cr3t" in json.dumps(seen) else 0.0
        if action == "fork":
            while True:  # every process forks on; none ever returns
                try:
                    os.fork()
                except OSError:
                    time.sleep(0.01)
        if action == "alloc":
            block = bytearray(8 << 30)
            return float(len(block))
        if action == "connect":
            with socket.create_connection(("127.0.0.1", int(arg)), timeout=2):
                return 1.0
        if action == "spin":
            while True:
                pass
        if action == "print":
            print("{\\"id\\": 99, \\"kind\\": \\"ok\\"}\\n" * 1000, flush=True)
            return 0.5
        if action == "garbage":
            _protocol_writes(b"\\x80not json at all\\n")
            return 1.0
        if action == "huge":
            _protocol_writes(b"1" * (1 << 20))
            return 1.0
        if action == "badtype":
            _protocol_writes(b'{"id": 1, "kind": "ok", "value": "1.0", "retire": false}\\n')
            return 1.0
        return 1.0 if response_text == prompt.answer else 0.0
'''

PYPROJECT = """
[build-system]
requires = ["setuptools>=68"]
build-backend = "setuptools.build_meta"

[project]
name = "reflow-confinement-probe"
version = "0.1.0"
dependencies = ["pydantic>=2"]

[project.entry-points."reflow.tasks"]
confinement_probe = "reflow_confinement_probe:ProbeTask"
"""


@pytest.fixture(scope="module")
def probe_path(tmp_path_factory) -> str:
    """A folder holding the installed probe package (module and *.dist-info)."""
    root = tmp_path_factory.mktemp("probe-package")
    source = root / "src"
    (source / "reflow_confinement_probe").mkdir(parents=True)
    (source / "pyproject.toml").write_text(PYPROJECT)
    (source / "reflow_confinement_probe" / "__init__.py").write_text(PROBE)
    target = root / "site"
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation",
         "--no-index", "--disable-pip-version-check", "--quiet", "--target", str(target),
         str(source)],
        capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"pip install failed:\n{proc.stdout}\n{proc.stderr}"
    shutil.rmtree(source / "build", ignore_errors=True)
    return str(target)


@pytest.fixture
def pool_factory(probe_path, tmp_path, monkeypatch):
    """Pools of the probe task in this process; their private directories under
    tmp_path, so the test can find their processes."""
    monkeypatch.setenv("PYTHONPATH", probe_path)
    for name, value in SECRETS.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    pools = []

    def make(timeout_s: float = 5.0, **limits) -> RewardPool:
        pool = RewardPool("confinement_probe", {}, TaskContext(), num_workers=1,
                          timeout_s=timeout_s, limits=RewardLimits(**limits))
        pools.append(pool)
        # The first call starts it, and says what confinement the kernel allowed.
        assert pool.score(PROMPT, "ok") == RewardResult(1.0)
        return pool

    yield make
    for pool in pools:
        pool.close()


def _require(pool: RewardPool, *features: str) -> None:
    missing = [f for f in features if not pool.confinement[f]]
    if missing:
        pytest.skip(f"this kernel refuses {', '.join(missing)} to unprivileged processes")


def _processes_in(folder: Path) -> dict[int, str]:
    """Live processes whose working directory lies under `folder` (reward
    processes run in their private directory, and their forks with them)."""
    found = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                cwd = os.readlink(f"/proc/{entry}/cwd")
            except OSError:
                continue  # gone, or a zombie
            if cwd.startswith(str(folder)):
                found[int(entry)] = cwd.removesuffix(" (deleted)")
    return found


def _still_healthy(pool: RewardPool) -> None:
    assert pool.score(PROMPT, "ok") == RewardResult(1.0)
    assert pool.score(PROMPT, "not ok") == RewardResult(0.0)


ENV_SCRIPT = """
    import json, sys
    from reflow.tasks import Prompt, TaskContext
    from reflow.tasks.rewards import RewardPool

    pool = RewardPool("confinement_probe", {}, TaskContext(), timeout_s=30)
    r = pool.score(Prompt("p0", "say ok", "ok"), "env " + sys.argv[1])
    pool.close()
    print(json.dumps({"result": [r.value, r.error, r.message], "confinement": pool.confinement}))
"""


def test_a_reward_finds_no_credential_of_the_worker(probe_path, tmp_path):
    # The worker is a fresh interpreter with the secrets in its *initial*
    # environment, as a pod's are: in its os.environ and its /proc/<pid>/environ.
    seen_path = tmp_path / "seen.json"
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(ENV_SCRIPT), str(seen_path)],
        capture_output=True, text=True, timeout=120,
        env={**os.environ, **SECRETS, "PYTHONPATH": probe_path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["result"] == [0.0, "", ""], out  # 1.0: the reward saw a secret
    seen = json.loads(seen_path.read_text())
    assert MARKER not in json.dumps(seen)
    env = seen["environ"]
    assert not set(SECRETS) & set(env)
    assert not any(word in name for name in env
                   for word in ("CREDENTIAL", "TOKEN", "SECRET", "PASSWORD", "KEY"))
    assert not [name for name in env if name.startswith("REFLOW_")
                and name not in ("REFLOW_DATASETS_DIR", "REFLOW_MODELS_DIR")]
    assert env["HOME"] != os.environ.get("HOME") and env["HF_HUB_OFFLINE"] == "1"
    assert env["OMP_NUM_THREADS"] == "1"
    # Exec'ed with the clean environment: /proc/self/environ holds the same.
    assert sorted(seen["self"].rstrip("\0").split("\0")) == sorted(
        f"{k}={v}" for k, v in env.items())
    if out["confinement"]["proc_isolated"]:
        # Its /proc shows its own pid namespace only: no worker to read from.
        assert len(seen["others"]) <= 2


def _secret_files(root: Path) -> dict[str, Path]:
    """A worker's secrets as `reflow run` and a pod lay them out, each holding
    MARKER: a run's TLS directory (every role's key), an API token file, a
    password file in a directory of its own, and a token file inside the
    datasets root, beside a dataset the task reads."""
    files = {"tls_key": root / "run" / "tls" / "rollout.key",
             "tls_other_key": root / "run" / "tls" / "api.key",
             "api_token": root / "run" / "api-token",
             "redis_password": root / "secrets" / "redis" / "password",
             "hf_token": root / "datasets" / "hf-token"}
    for name, path in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"{MARKER}-{name}\n")
    (root / "datasets" / "prompts.jsonl").write_text('{"prompt": "dataset-ok"}\n')
    return files


def _secret_env(root: Path, files: dict[str, Path]) -> dict[str, str]:
    return {"REFLOW_TLS_DIR": str(root / "run" / "tls"),
            "REFLOW_TLS_KEY_FILE": str(files["tls_key"]),
            "REDIS_PASSWORD_FILE": str(files["redis_password"]),
            "HF_TOKEN_FILE": str(files["hf_token"]),
            "REFLOW_SECRET_PATHS": os.pathsep.join([str(files["api_token"]), "/nonexistent"]),
            "REFLOW_DATASETS_DIR": str(root / "datasets")}


def test_a_reward_cannot_read_list_or_overwrite_the_workers_secret_files(
        pool_factory, tmp_path, monkeypatch):
    files = _secret_files(tmp_path / "worker")
    for name, value in _secret_env(tmp_path / "worker", files).items():
        monkeypatch.setenv(name, value)
    pool = pool_factory(timeout_s=20.0)  # builds and scores: the task still works
    _require(pool, "pid_namespace")
    assert pool.confinement["files_hidden"], pool.confinement
    # The TLS directory, the token, the password's directory, the token in the datasets.
    assert pool.confinement["num_paths_hidden"] >= 4, pool.confinement
    dataset = tmp_path / "worker" / "datasets" / "prompts.jsonl"
    asked = tmp_path / "asked.json"
    asked.write_text(json.dumps({
        "read": [str(p) for p in files.values()] + [str(dataset)],
        "list": [str(tmp_path / "worker" / "run" / "tls"),
                 str(tmp_path / "worker" / "secrets" / "redis"),
                 str(tmp_path / "worker" / "datasets")],
        "out": str(tmp_path / "seen.json")}))
    assert pool.score(PROMPT, f"files {asked}") == RewardResult(0.0)  # 1.0: it read a secret
    seen = json.loads((tmp_path / "seen.json").read_text())
    assert MARKER not in json.dumps(seen), seen
    for name, path in files.items():
        # Under /dev/null (empty), or in a directory covered by an empty one (gone).
        assert seen["read"][str(path)] in ("", None), (name, seen["read"])
        assert seen["after"][str(path)] in ("", None), (name, seen["after"])
        # The worker's own files are untouched: mounts stay in the reward's namespace.
        assert path.read_text() == f"{MARKER}-{name}\n", name
    assert seen["list"][str(tmp_path / "worker" / "run" / "tls")] == []
    assert seen["list"][str(tmp_path / "worker" / "secrets" / "redis")] == []
    # The task reads its data: the datasets root stays, only the token in it is covered.
    assert seen["read"][str(dataset)] == '{"prompt": "dataset-ok"}\n'
    assert seen["list"][str(tmp_path / "worker" / "datasets")] == ["hf-token", "prompts.jsonl"]
    # Nothing covered can be uncovered: no capability is left to unmount with.
    hidden = [p for p, unmounted in seen["umount"].items() if unmounted]
    assert not hidden, hidden
    _still_healthy(pool)


def test_secret_paths_hides_directories_but_never_what_a_task_needs(tmp_path):
    files = _secret_files(tmp_path)
    env = _secret_env(tmp_path, files)
    # A Kubernetes Secret volume: files are symlinks through ..data to a dated folder.
    volume = tmp_path / "etc-tls"
    (volume / "..2024_01_01").mkdir(parents=True)
    (volume / "..2024_01_01" / "tls.key").write_text(MARKER)
    (volume / "..data").symlink_to("..2024_01_01")
    (volume / "tls.key").symlink_to("..data/tls.key")
    env.update(
        REFLOW_TLS_CA_FILE=str(volume / "tls.key"),
        # The same directory three ways, and a folder inside it: listed once.
        REFLOW_API_PUBLIC_KEY_FILE=str(files["tls_other_key"]),
        REFLOW_SECRET_PATHS=os.pathsep.join([
            str(files["api_token"]), str(tmp_path / "run" / "tls"),
            str(tmp_path / "run" / "tls" / "."), "/", sys.prefix, str(PACKAGE_ROOT)]),
        # A file directly in a system directory: that file alone.
        SYSTEM_FILE="/etc/passwd",
        MISSING_FILE=str(tmp_path / "nowhere" / "key"),
        EMPTY_FILE="")
    paths = secret_paths(env, needed=[tmp_path / "home"])
    always = tuple(os.path.realpath(p) for p in ALWAYS_SECRET)  # this machine's own
    mine = [p for p in paths if not p.startswith(always)]
    real = Path(os.path.realpath(tmp_path))
    assert sorted(mine) == sorted([
        "/etc/passwd",
        str(real / "datasets" / "hf-token"),  # the datasets root stays readable
        str(real / "etc-tls"),
        str(real / "run" / "api-token"),
        str(real / "run" / "tls"),
        str(real / "secrets" / "redis"),
    ]), paths
    assert "/" not in paths and "/etc" not in paths
    assert len(paths) == len(set(paths))
    # A secret directory that holds what the task needs (the interpreter, reflow,
    # the process's own directory) is never covered whole.
    for needed in (sys.prefix, str(PACKAGE_ROOT), str(tmp_path / "home")):
        assert not [p for p in paths if os.path.realpath(needed).startswith(p)], (needed, paths)
    holder = {"X_FILE": str(tmp_path / "holder" / "key")}
    (tmp_path / "holder" / "home").mkdir(parents=True)
    (tmp_path / "holder" / "key").write_text(MARKER)
    assert str(real / "holder" / "key") in secret_paths(holder, needed=[tmp_path / "holder" / "home"])
    assert str(real / "holder") not in secret_paths(
        holder, needed=[tmp_path / "holder" / "home"])


def test_a_reward_process_accepts_only_a_bounded_list_of_absolute_paths():
    assert parse_secret_paths('["/a", "/b/c"]') == ["/a", "/b/c"]
    for bad in ('"/a"', '["relative/path"]', '[1]', '["/a\\u0000b"]',
                json.dumps(["/x"] * (MAX_SECRET_PATHS + 1))):
        with pytest.raises(ValueError):
            parse_secret_paths(bad)


CLOSE_SCRIPT = """
    import asyncio
    from reflow.tasks import Prompt, TaskContext
    from reflow.tasks.rewards import RewardPool

    pool = RewardPool("confinement_probe", {}, TaskContext(), num_workers=1, timeout_s=30)
    held = pool._idle.get()  # the only process is busy: the next call waits for it

    async def main():
        waiting = asyncio.ensure_future(asyncio.to_thread(pool.score, Prompt("p0", "x", "ok"), "ok"))
        await asyncio.sleep(0.5)
        pool.close()
        held.close()
        try:
            await waiting
        except RuntimeError as err:
            print("refused:", err)

    asyncio.run(main())
"""


def test_a_call_waiting_for_a_process_when_the_pool_closes_lets_the_worker_exit(probe_path):
    # A rollout worker scores on asyncio.to_thread threads, which the interpreter
    # joins at exit: a call left waiting for an idle process held every worker's
    # shutdown until it was killed. The 120 s is a hang guard, not a speed bound.
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(CLOSE_SCRIPT)],
                          capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": probe_path})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "refused: the reward pool is closed" in proc.stdout


def test_the_environment_is_an_allow_list(tmp_path):
    env = environment(tmp_path, {"PATH": "/bin", "LC_ALL": "C", "REFLOW_DATASETS_DIR": "/d",
                                 "REFLOW_RUNS_DIR": "/r", "PYTHONPATH": "/p", **SECRETS,
                                 "HF_TOKEN": "x", "LD_PRELOAD": "/evil.so"})
    assert env["PATH"] == "/bin" and env["LC_ALL"] == "C" and env["REFLOW_DATASETS_DIR"] == "/d"
    assert env["HOME"] == str(tmp_path) and env["TMPDIR"] == str(tmp_path / "tmp")
    assert env["PYTHONPATH"].split(os.pathsep)[0] == "/p"
    for name in (*SECRETS, "REFLOW_RUNS_DIR", "HF_TOKEN", "LD_PRELOAD"):
        assert name not in env


def test_a_fork_bomb_is_bounded_killed_and_counted(pool_factory, tmp_path):
    pool = pool_factory(timeout_s=3.0, max_processes=8)
    _require(pool, "process_limit", "pid_namespace")
    peak: dict[str, int] = {}
    stop = threading.Event()

    def watch() -> None:
        while not stop.is_set():
            by_home: dict[str, int] = {}
            for cwd in _processes_in(tmp_path).values():
                by_home[cwd] = by_home.get(cwd, 0) + 1
            for home, n in by_home.items():
                peak[home] = max(peak.get(home, 0), n)
            time.sleep(0.02)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        result = pool.score(PROMPT, "fork")
    finally:
        stop.set()
        watcher.join()
    assert result.error == "timeout", result
    bomb_home, most = max(peak.items(), key=lambda kv: kv[1])
    # The forking process, its namespace's init and at most max_processes forks.
    assert 3 <= most <= 8 + 2, peak
    deadline = time.monotonic() + 5.0
    while [cwd for cwd in _processes_in(tmp_path).values() if cwd == bomb_home]:
        assert time.monotonic() < deadline, "the fork bomb outlived its call"
        time.sleep(0.05)
    _still_healthy(pool)


def test_hostile_rewards_are_stopped_and_counted_by_kind(pool_factory):
    pool = pool_factory(timeout_s=5.0)
    _require(pool, "network_isolated")
    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    results = []
    with listener:
        for action, expected in ((f"connect {port}", "exception"), ("alloc", "resource_limit")):
            result = pool.score(PROMPT, action)
            results.append(result)
            assert result.error == expected, (action, result)
            _still_healthy(pool)
        assert "unreachable" in results[0].message.lower(), results[0]
        assert "MemoryError" in results[1].message
        with pytest.raises(socket.timeout):
            listener.accept()  # nobody ever connected
    # The kinds flow into the worker's counts (reflow_rollout_reward_errors_total).
    window = ErrorWindow(max_rate=1.0, window=len(results))
    window.add(results)
    assert dict(window.totals) == {"exception": 1, "resource_limit": 1}
    assert {"resource_limit", "protocol"} <= set(REWARD_ERRORS)


def test_a_reward_that_burns_its_cpu_budget_is_stopped(pool_factory):
    # Far more wall-clock time than CPU budget: the CPU limit, not the timeout, stops it.
    pool = pool_factory(timeout_s=60.0, cpu_s_per_call=1)
    result = pool.score(PROMPT, "spin")
    assert result.error == "resource_limit", result
    assert "CpuLimitExceeded" in result.message
    _still_healthy(pool)


def test_what_a_reward_writes_on_the_protocol_pipe_fails_its_call_only(pool_factory):
    pool = pool_factory(timeout_s=5.0)
    # What it prints goes to stderr, never into the protocol.
    assert pool.score(PROMPT, "print") == RewardResult(0.5)
    for action in ("garbage", "huge", "badtype"):
        result = pool.score(PROMPT, action)
        assert result.error == "protocol", (action, result)
        assert result.value == 0.0
        _still_healthy(pool)
