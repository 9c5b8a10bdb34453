"""No process outlives the job that started it: real process trees, killed
with SIGKILL where a crash is the point.

- an engine's processes end with the process that started them, even when it
  is SIGKILLed and they are re-parented (procs.watch_parent, loaded by vLLM as
  a general plugin), with a child spawned as vLLM spawns its engine core and
  with vLLM's own engine;
- a service's whole process group goes when it is stopped, including what it
  left behind when it died (procs.stop_processes);
- a local placement is stopped clients first and the replay buffer last, each
  service cleanly, leaving no process (LocalBackend.release).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from importlib.metadata import entry_points
from pathlib import Path

import psutil
import pytest

from reflow import procs

REPO = Path(__file__).resolve().parents[2]


def _gone(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def _wait_gone(pids: list[int], timeout_s: float) -> list[int]:
    """The pids still running after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.1)
    return [p for p in pids if not _gone(p)]


@contextlib.contextmanager
def _engine_parent(*args: str):
    """(the parent, the pids of what it started); everything is killed afterwards,
    whatever the test found."""
    parent = subprocess.Popen([sys.executable, "-m", "tests.integration.engine_parent", *args],
                              cwd=REPO, stdout=subprocess.PIPE, text=True)
    children: list[int] = []
    try:
        for line in parent.stdout:  # vLLM logs to stdout too
            if line.startswith("pids:"):
                children += [int(pid) for pid in line.split()[1:]]
                break
        assert children, f"the engine parent exited ({parent.wait()}) before starting any"
        yield parent, children
    finally:
        parent.kill()
        parent.wait()
        parent.stdout.close()
        for pid in children:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


def test_vllm_loads_the_parent_watch_as_a_general_plugin():
    plugins = {ep.name: ep.value for ep in entry_points(group="vllm.general_plugins")}
    assert plugins.get("reflow_watch_parent") == "reflow.procs:watch_parent", (
        "reinstall the package (pip install -e .) to register its entry points")


@pytest.mark.slow
def test_a_spawned_engine_child_ends_when_its_parent_is_sigkilled():
    with _engine_parent("spawn") as (parent, children):
        parent.kill()
        parent.wait()
        # Re-parented now, and nobody sweeps them: they end on their own.
        assert _wait_gone(children, procs.ENGINE_EXIT_GRACE_S + 5) == []


@pytest.mark.slow
def test_vllms_engine_core_ends_when_the_rollout_process_is_sigkilled(tiny_model):
    with _engine_parent("vllm", tiny_model) as (parent, children):
        names = [psutil.Process(pid).name() for pid in children]
        assert any("EngineCore" in name for name in names), names
        parent.kill()
        parent.wait()
        assert _wait_gone(children, procs.ENGINE_EXIT_GRACE_S + 10) == []


def test_stopping_a_dead_service_takes_what_it_left_behind(tmp_path):
    # A service that started a child which does not watch its parent, then died.
    script = ("import subprocess, sys, time\n"
              "child = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
              "print(child.pid, flush=True)\n"
              "time.sleep(600)\n")
    service = procs.spawn([sys.executable, "-c", script], str(tmp_path / "service.log"),
                          new_group=True)
    deadline = time.monotonic() + 30
    while not (tmp_path / "service.log").read_text().strip():
        assert time.monotonic() < deadline and service.poll() is None
        time.sleep(0.05)
    orphan = int((tmp_path / "service.log").read_text().split()[0])
    try:
        os.kill(service.pid, signal.SIGKILL)
        service.wait()
        assert not _gone(orphan)  # re-parented, out of the service's process tree
        procs.stop_processes([service], timeout_s=5)
        assert _wait_gone([orphan], 5) == []
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(orphan, signal.SIGKILL)


@pytest.mark.slow
def test_a_placement_stops_clients_first_the_buffer_last_and_leaves_nothing(
        redis_server, tmp_path):
    from reflow.scheduler.cluster.local import LocalBackend

    backend = LocalBackend(redis_server.url)
    placement = backend.place("teardown", tmp_path)
    processes = dict(placement.processes)
    exited: dict[str, float] = {}

    def watch(name: str, pid: int) -> None:  # when each exits (zombie), without reaping it
        while not _gone(pid):
            time.sleep(0.01)
        exited[name] = time.monotonic()

    try:
        watchers = [threading.Thread(target=watch, args=(n, p.pid), daemon=True)
                    for n, p in processes.items()]
        for w in watchers:
            w.start()
        backend.release(placement)
        for w in watchers:
            w.join(5)
        assert set(exited) == {"replay", "rollout", "trainer"}
        assert exited["replay"] > max(exited["rollout"], exited["trainer"]), exited
        # Each stopped on its SIGTERM, none waited for SIGKILL (15 s later).
        assert {n: p.returncode for n, p in processes.items()} == {
            "replay": 0, "rollout": 0, "trainer": 0}
        assert procs.leftovers({p.pid for p in processes.values()}) == []
    finally:
        procs.stop_processes(list(processes.values()), timeout_s=5)
