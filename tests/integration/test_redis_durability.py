"""The embedded Redis's append-only file: each fsync policy reaches the server,
anything else is refused naming the setting, and writes Redis acknowledged
survive a SIGKILL of the server under either policy (what `always` adds is
survival of a machine crash, which no test here can stage;
docs/operations/faults.md, "Durability")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import redis

from reflow.replay.embedded import APPENDFSYNC, EmbeddedRedis

# With the slow tests, one at a time: under `everysec` Redis postpones an AOF write
# while a background fsync is still running (up to 2 s), so a SIGKILL right after
# the writes can lose the last few when another test is loading the disk (seen on
# two pytest-xdist workers: 494 of 500).
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("appendfsync", APPENDFSYNC)
def test_acknowledged_writes_survive_a_sigkill_of_the_server(tmp_path, appendfsync):
    server = EmbeddedRedis(tmp_path, appendfsync=appendfsync).start()
    try:
        client = redis.Redis.from_url(server.url)
        assert client.config_get("appendfsync") == {"appendfsync": appendfsync}
        for i in range(500):
            client.rpush("samples", f"s{i}")
        server.proc.kill()
        server.proc.wait()
    finally:
        server.stop()
    restarted = EmbeddedRedis(tmp_path, appendfsync=appendfsync).start()
    try:
        client = redis.Redis.from_url(restarted.url)
        assert client.llen("samples") == 500 and client.lindex("samples", -1) == b"s499"
    finally:
        restarted.stop()


def test_an_unknown_policy_is_refused_naming_the_setting(tmp_path):
    with pytest.raises(ValueError, match="appendfsync: 'no' is not one of everysec, always"):
        EmbeddedRedis(tmp_path, appendfsync="no")
    run = subprocess.run(
        [sys.executable, "-m", "reflow.cli", "run", "examples/quickstart.yaml", "--dry-run",
         "--redis-appendfsync", "sometimes"], cwd=REPO, capture_output=True, text=True)
    assert run.returncode == 2
    assert "--redis-appendfsync: 'sometimes' is not one of everysec, always" in run.stderr
    env = {k: v for k, v in os.environ.items() if k != "REDIS_URL"}
    serve = subprocess.run(
        [sys.executable, "-m", "reflow.cli", "serve", "replay", "--port", "0"], cwd=tmp_path,
        env={**env, "REFLOW_REDIS_APPENDFSYNC": "sometimes"}, capture_output=True, text=True,
        timeout=120)
    assert serve.returncode != 0
    assert "REFLOW_REDIS_APPENDFSYNC: 'sometimes' is not one of everysec, always" in serve.stderr
    assert not (tmp_path / ".reflow").exists()  # refused before any Redis started
