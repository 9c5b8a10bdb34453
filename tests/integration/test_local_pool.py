"""The local backend's free pool (REFLOW_LOCAL_MAX_WORKERS), with real
`reflow serve` processes: a job with a range of rollout workers is placed with
what fits, a second job waits PENDING (NoCapacity) until the first gives a
rollout process back, and a process claimed later answers at a new port, is
listed in endpoints.json, and goes down with the placement."""

from __future__ import annotations

import json

import pytest

from reflow import procs, rpc
from reflow.core.errors import NoCapacity
from reflow.scheduler.cluster.local import LocalBackend

pytestmark = pytest.mark.slow


def test_a_range_job_takes_what_fits_gives_back_and_grows_with_processes(redis_server,
                                                                          tmp_path):
    backend = LocalBackend(redis_server.url, max_workers=4)
    first = backend.place("first", tmp_path / "first", rollout_range=(1, 4))
    second = None
    try:
        # Four of five wanted fit: the trainer and three rollout processes.
        assert len(first.rollout_addresses) == 3
        assert set(first.processes) == {"replay", "trainer", "rollout", "rollout-1", "rollout-2"}
        with pytest.raises(NoCapacity, match="REFLOW_LOCAL_MAX_WORKERS=4"):
            backend.place("second", tmp_path / "second")
        assert backend.claim_rollout(first) is None  # no room to grow

        # The last rollout processes are given back, one at a time: each stops, and
        # their room is the next job's.
        given_back = []
        for name in ("rollout-2", "rollout-1"):
            leaving = first.rollout_addresses[-1]
            detached = backend.detach_rollout(first, leaving)
            assert name not in first.processes and name not in first.launches
            backend.release_detached(first, detached)
            assert detached.poll() is not None
            given_back.append(leaving)
        assert len(first.rollout_addresses) == 1
        second = backend.place("second", tmp_path / "second", rollout_range=(1, 1))
        assert backend.claim_rollout(first) is None

        # The second job ends: the first grows into the room, with a new process.
        backend.release(second)
        second = None
        grown = backend.claim_rollout(first)
        assert grown is not None and first.rollout_addresses[-1] == grown
        rpc.wait_healthy(grown, 30, role="rollout")
        endpoints = json.loads((tmp_path / "first" / "endpoints.json").read_text())
        assert endpoints["rollout-1"]["grpc"] == grown
        pids = {p.pid for p in first.processes.values()}
    finally:
        if second is not None:
            backend.release(second)
        backend.release(first)
    assert procs.leftovers(pids) == []
    assert backend._in_use == {}
