"""Where a rollout engine's processes run: the engine core on the rollout cores,
its front end wherever there is room (procs.engine_process_affinity)."""

from __future__ import annotations

import json
import os
import subprocess  # nosec B404 # a fixed argv under sys.executable
import sys
import threading

import pytest

from reflow import procs

CPUS = sorted(os.sched_getaffinity(0))
pytestmark = pytest.mark.skipif(len(CPUS) < 2, reason="needs two CPUs to tell the sets apart")


def _child_affinity() -> set[int]:
    out = subprocess.run(  # nosec B603 # fixed argv
        [sys.executable, "-c", "import json, os; print(json.dumps(sorted(os.sched_getaffinity(0))))"],
        check=True, capture_output=True, text=True).stdout
    return set(json.loads(out))


def _thread_affinity(tid: int) -> set[int]:
    return os.sched_getaffinity(tid)


def test_the_engine_process_gets_the_engine_cores_and_every_thread_gets_the_rest_back(monkeypatch):
    engine = {CPUS[0]}
    monkeypatch.setenv(procs.ENGINE_CPU_AFFINITY_ENV, str(CPUS[0]))
    before = os.sched_getaffinity(0)
    started = threading.Event()
    stop = threading.Event()
    seen: dict[str, int] = {}

    def io_thread() -> None:  # as the engine client's threads, started during the build
        seen["tid"] = threading.get_native_id()
        started.set()
        stop.wait(10)

    worker = threading.Thread(target=io_thread)
    with procs.engine_process_affinity():
        assert _child_affinity() == engine  # what the engine core inherits
        worker.start()
        started.wait(5)
        assert _thread_affinity(seen["tid"]) == engine
    try:
        assert os.sched_getaffinity(0) == before
        assert _thread_affinity(seen["tid"]) == before  # widened by its thread id
        assert _child_affinity() == before
    finally:
        stop.set()
        worker.join()


def test_without_an_engine_set_nothing_moves(monkeypatch):
    monkeypatch.delenv(procs.ENGINE_CPU_AFFINITY_ENV, raising=False)
    before = os.sched_getaffinity(0)
    with procs.engine_process_affinity():
        assert os.sched_getaffinity(0) == before
        assert _child_affinity() == before
    assert os.sched_getaffinity(0) == before


def test_a_thread_that_was_already_there_keeps_its_own_cores(monkeypatch):
    """Another job's engine may be starting on another thread, narrowed to its
    engine cores: finishing this start must not widen it."""
    monkeypatch.setenv(procs.ENGINE_CPU_AFFINITY_ENV, str(CPUS[0]))
    narrowed = threading.Event()
    stop = threading.Event()
    seen: dict[str, int] = {}

    def other_engine_start() -> None:
        seen["tid"] = threading.get_native_id()
        os.sched_setaffinity(0, {CPUS[-1]})
        narrowed.set()
        stop.wait(10)

    other = threading.Thread(target=other_engine_start)
    other.start()
    narrowed.wait(5)
    try:
        with procs.engine_process_affinity():
            pass
        assert _thread_affinity(seen["tid"]) == {CPUS[-1]}
    finally:
        stop.set()
        other.join()
