"""A replay-buffer server process for restart tests: `python -m
tests.integration.replay_standby PORT REDIS_URL` builds everything, prints
`ready`, waits for a line on stdin, binds PORT, prints `serving`, and serves
until it is killed. Started ahead as the replacement of a server about to be
killed, its restart takes a bind, not the seconds of Python imports."""

import sys
import threading


def main() -> None:
    port, redis_url = int(sys.argv[1]), sys.argv[2]
    from reflow.replay.server import serve
    from reflow.replay.store import ReplayStore

    store = ReplayStore.from_url(redis_url)
    print("ready", flush=True)
    sys.stdin.readline()
    server, _ = serve(store, f"127.0.0.1:{port}")  # held: a dropped server stops
    print("serving", flush=True)
    threading.Event().wait()
    server.stop(0)


if __name__ == "__main__":
    main()
