"""The replay-buffer *process* dies (SIGKILL) mid-stream and comes back on the
same port: rollout-side puts ride out the gap, nothing put is lost, and a
lease the dead process handed out comes back when it expires."""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from reflow import rpc
from reflow.core.config import ReplayConfig
from reflow.procs import free_port
from reflow.replay.client import GrpcReplayClient
from tests.integration.samples import make_group

pytestmark = pytest.mark.slow


def start_buffer(port: int, redis_url: str, log) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-m", "reflow.cli", "serve", "replay", "--port", str(port)],
                            env={**os.environ, "REDIS_URL": redis_url}, stdout=log, stderr=log)
    rpc.wait_healthy(f"127.0.0.1:{port}", 30)
    return proc


def test_buffer_process_restart_mid_stream_loses_nothing(redis_server, redis_client, tmp_path):
    port = free_port()
    log = open(tmp_path / "replay.log", "ab")
    proc = start_buffer(port, redis_server.url, log)
    writer = GrpcReplayClient(f"127.0.0.1:{port}", deadline_s=5, retry_s=60)
    writer.configure("job", ReplayConfig(max_staleness=10, replay_cap=0.0))
    writer.put("job", make_group("first"))
    # Leased from the process about to die, never released.
    assert writer.sample("job", 4, lease_ttl_s=1.5, timeout_s=0.1) is not None
    put_groups: list[str] = []
    errors: list[Exception] = []

    def write():
        try:
            for i in range(60):
                writer.put("job", make_group(f"g{i}"))
                put_groups.append(f"g{i}")
                time.sleep(0.02)
        except Exception as err:  # noqa: BLE001 - surfaced by the assertion below
            errors.append(err)

    thread = threading.Thread(target=write)
    thread.start()
    while len(put_groups) < 20:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    time.sleep(0.5)  # the writer now hits a dead port and retries
    proc = start_buffer(port, redis_server.url, log)
    try:
        thread.join(60)
        assert not errors, errors
        assert len(put_groups) == 60
        time.sleep(1.6)  # the lease from before the crash expires
        reader = GrpcReplayClient(f"127.0.0.1:{port}")
        seen = set()
        while batch := reader.sample("job", 4, 30, timeout_s=0.2):
            seen |= {t.group_id for t in batch.trajectories}
            reader.release("job", batch.lease_id)
        assert seen == set(put_groups) | {"first"}
        stats = reader.stats("job")
        assert stats.put_total == 61 * 4 and stats.expired_leases_total == 1
        reader.close()
    finally:
        writer.close()
        proc.terminate()
        proc.wait(10)
        log.close()
