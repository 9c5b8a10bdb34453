"""Sandbox executions per second and their latency, with the pool warm.

    python bench/sandbox.py --out bench/out/sandbox.json
    python bench/sandbox.py --grpc --out bench/out/sandbox.json   # and through gRPC
    python bench/sandbox.py --concurrency 1,4 --trivial-runs 20 --sleep-rounds 1 \\
        --out /tmp/sandbox.json                                    # a smoke run, seconds

Two programs: a trivial one (`print(1)`: what a sandbox costs when the program
costs nothing) and a one-second one (`time.sleep(1)`: a program that holds its
slot without using a CPU, so the figure is the sandbox's overhead on top of the
second, not the CPU's speed). Each at `--concurrency` callers at once, every
caller running its programs one after another: `--trivial-runs` trivial ones
shared among the callers, `--sleep-rounds` sleeping ones each. Latency is one `execute` call as the
caller sees it (a wait for a slot and a cold start included); `cold` is the share
of executions that found no warm sandbox and started their own.

The service is the real one (bubblewrap, `--pool-size` warm sandboxes, room for
the most callers at once) in this process, called through LocalSandboxClient;
`--grpc` adds the same through its gRPC server on loopback, this process calling
as a rollout worker does (a job pass, GrpcSandboxClient). Before each row the pool
is refilled and a few programs run unmeasured. Benchmarks are not tests: nothing
here asserts a speed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import threading
import time
from pathlib import Path

from replay_buffer import percentile  # bench/replay_buffer.py

from reflow.sandbox.client import LocalSandboxClient
from reflow.sandbox.service import SandboxService, SandboxSettings
from reflow.sandbox.types import OK, ExecLimits, ExecRequest

PROGRAMS = {"print(1)": "print(1)", "sleep(1)": "import time\ntime.sleep(1)"}
JOB = "bench-sandbox"
# How long the pool gets to fill before a row.
REFILL_WAIT_S = 30.0


def wait_warm(service: SandboxService) -> None:
    deadline = time.monotonic() + REFILL_WAIT_S
    while (service.stats().warm_processes < service.settings.pool_size
           and time.monotonic() < deadline):
        time.sleep(0.05)


def measure(client, service: SandboxService, program: str, callers: int,
            per_caller: int) -> dict:
    request = ExecRequest(PROGRAMS[program], limits=ExecLimits(wall_s=30.0))
    for _ in range(2):  # unmeasured: first calls of a channel, imports
        client.execute(request, job_id=JOB)
    wait_warm(service)
    latencies: list[float] = []
    failures: list[str] = []
    lock = threading.Lock()

    def caller() -> None:
        mine, bad = [], []
        for _ in range(per_caller):
            start = time.perf_counter()
            result = client.execute(request, job_id=JOB)
            mine.append(time.perf_counter() - start)
            if result.status != OK:
                bad.append(result.status)
        with lock:
            latencies.extend(mine)
            failures.extend(bad)

    cold_before = service.stats().cold_starts_total
    threads = [threading.Thread(target=caller) for _ in range(callers)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - start
    cold = service.stats().cold_starts_total - cold_before
    ms = [x * 1000 for x in latencies]
    return {"program": program, "callers": callers, "executions": len(ms),
            "executions_per_s": len(ms) / elapsed, "p50_ms": statistics.median(ms),
            "p99_ms": percentile(ms, 0.99), "mean_ms": statistics.fmean(ms),
            "cold_fraction": cold / len(ms), "not_ok": len(failures)}


def run_all(client, service: SandboxService, path: str, args) -> list[dict]:
    rows = []
    for program in PROGRAMS:
        for callers in args.concurrency:
            per_caller = (max(1, -(-args.trivial_runs // callers)) if program == "print(1)"
                          else args.sleep_rounds)
            row = measure(client, service, program, callers, per_caller)
            row["path"] = path
            rows.append(row)
            print(f"  {path:<5} {program:<9} {callers:>3} callers: "
                  f"{row['executions_per_s']:.1f}/s", file=sys.stderr, flush=True)
    return rows


def grpc_client(service: SandboxService):
    """The service behind its gRPC server, and a client that calls as a rollout
    worker does: the deployment credential and a rollout pass, no signing key."""
    from reflow import capabilities, rpcauth
    from reflow.core.grants import JOB_TOKENS
    from reflow.sandbox.grpc_client import GrpcSandboxClient
    from reflow.sandbox.server import serve

    rpcauth.ensure_local_credentials()
    scheduler_key = rpcauth.credentials().signing["scheduler"]
    server, port = serve(service, "127.0.0.1:0")
    for env in rpcauth.SIGNING_KEY_ENVS.values():
        os.environ.pop(env, None)
        os.environ.pop(f"{env}_FILE", None)
    rpcauth.reset_credentials()
    JOB_TOKENS.grant(JOB, capabilities.issue_pass(scheduler_key, JOB, "rollout"))
    return server, GrpcSandboxClient(f"127.0.0.1:{port}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--concurrency", default="1,8,32",
                        help="callers at once, comma separated")
    parser.add_argument("--trivial-runs", type=int, default=200,
                        help="print(1) runs per row, shared among its callers")
    parser.add_argument("--sleep-rounds", type=int, default=3,
                        help="sleep(1) runs per caller")
    parser.add_argument("--pool-size", type=int, default=8)
    parser.add_argument("--grpc", action="store_true", help="also measure through gRPC")
    args = parser.parse_args()
    try:
        args.concurrency = [int(c) for c in args.concurrency.split(",")]
    except ValueError:
        parser.error(f"--concurrency: {args.concurrency!r} is not a list of numbers")

    service = SandboxService(SandboxSettings(pool_size=args.pool_size,
                                             max_concurrent=max(args.concurrency)))
    rows = []
    try:
        rows += run_all(LocalSandboxClient(service), service, "local", args)
        if args.grpc:
            server, client = grpc_client(service)
            try:
                rows += run_all(client, service, "grpc", args)
            finally:
                client.close()
                server.stop(0)
    finally:
        service.close()

    print(f"{'path':<6} {'program':<9} {'callers':>7} {'runs':>5} {'exec/s':>8} "
          f"{'p50 ms':>8} {'p99 ms':>8} {'mean ms':>8} {'cold':>5} {'not ok':>6}")
    for r in rows:
        print(f"{r['path']:<6} {r['program']:<9} {r['callers']:>7} {r['executions']:>5} "
              f"{r['executions_per_s']:>8.1f} {r['p50_ms']:>8.1f} {r['p99_ms']:>8.1f} "
              f"{r['mean_ms']:>8.1f} {r['cold_fraction']:>5.2f} {r['not_ok']:>6}")
    out = {"rows": rows, "machine": {"cpus": os.cpu_count(), "kernel": platform.release(),
                                     "python": platform.python_version()},
           "settings": {k: v for k, v in vars(args).items() if k != "out"}}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
