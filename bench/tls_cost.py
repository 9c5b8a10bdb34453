"""What gRPC's mutual TLS costs: replay-buffer put throughput, a unary call's
latency and a new connection's handshake, TLS on against off.

    python bench/tls_cost.py --out bench/out/tls_cost.json
    python bench/tls_cost.py --put-samples 512 --calls 50 --connects 5 --repeats 1 \\
        --out /tmp/tls_cost.json                                   # a smoke run, seconds

The buffer is the real one: two `reflow serve replay` processes on one embedded
Redis, one with mutual TLS (the replay's certificate from a CA minted for the
run, as `reflow run` gives it) and one with REFLOW_TLS=off. This process is
their client as a rollout worker is: GRPO groups put through GrpcReplayClient
with a rollout job pass and no capability, and, with TLS, the rollout's
certificate. Measured per mode, the modes taking turns `--repeats` times:

- put: samples/s, `--put-samples` in chunks of `--put-chunk-groups` groups;
- GetStats: a unary call authorized by the job pass, p50 and p99 over `--calls`;
- health: grpc.health.v1 Check, the bare call (no credential), p50 and p99;
- connect: a new channel's first health check (TCP, and the handshake with TLS),
  p50 over `--connects`.

The table shows each figure's median over the repeats and TLS against
plaintext. Benchmarks are not tests: nothing here asserts a speed.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from replay_buffer import make_groups, percentile  # bench/replay_buffer.py

from reflow import procs, rpc, rpcauth, tlscerts
from reflow.core.config import ReplayConfig
from reflow.replay.embedded import EmbeddedRedis

MODES = ("plaintext", "mutual TLS")


def _tls_env(mode: str, certs: Path, role: str) -> dict[str, str]:
    """The TLS settings of a process of `role` in `mode`."""
    if mode == "plaintext":
        return {tlscerts.TLS_ENV: "off", tlscerts.TLS_CERT_ENV: "", tlscerts.TLS_KEY_ENV: "",
                tlscerts.TLS_CA_ENV: ""}
    return {tlscerts.TLS_ENV: "on", tlscerts.TLS_CERT_ENV: str(certs / f"{role}.crt"),
            tlscerts.TLS_KEY_ENV: str(certs / f"{role}.key"),
            tlscerts.TLS_CA_ENV: str(certs / tlscerts.CA_FILE)}


@contextlib.contextmanager
def _client_env(mode: str, certs: Path):
    """This process's TLS settings while it opens channels in `mode` (a channel
    reads them when it is made)."""
    saved = {k: os.environ.get(k) for k in _tls_env("mutual TLS", certs, "rollout")}
    os.environ.update(_tls_env(mode, certs, "rollout"))
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _start_buffer(mode: str, certs: Path, redis_url: str, log_dir: Path) -> tuple[object, str]:
    port = procs.free_ports(1)[0]
    env = {"REDIS_URL": redis_url, **rpcauth.role_env(None),
           **_tls_env(mode, certs, "replay")}
    log = log_dir / f"replay-{mode.replace(' ', '-')}.log"
    proc = procs.spawn([sys.executable, "-m", "reflow.cli", "serve", "replay", "--port",
                        str(port)], str(log), env=env)
    address = f"127.0.0.1:{port}"
    with _client_env(mode, certs):
        rpc.wait_healthy(address, 120, role="replay")
    return proc, address


def _latencies_ms(call, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        call()
        out.append((time.perf_counter() - start) * 1000)
    return out


def measure(mode: str, certs: Path, address: str, job: str, args) -> dict:
    """One turn of `mode`: put, GetStats, health, connect."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from reflow.replay.client import GrpcReplayClient

    chunk = args.put_chunk_groups * args.group_size
    batches = [make_groups(args.put_chunk_groups, args.group_size, args.prompt_tokens,
                           args.response_tokens, 0, f"{uuid.uuid4().hex[:6]}-{k}-")
               for k in range(max(1, args.put_samples // chunk))]
    check = health_pb2.HealthCheckRequest()
    with _client_env(mode, certs):
        client = GrpcReplayClient(address)
        client.put(job, make_groups(1, args.group_size, args.prompt_tokens,
                                    args.response_tokens, 0, f"warm-{uuid.uuid4().hex[:6]}-"))
        start = time.perf_counter()
        samples = sum(client.put(job, batch) for batch in batches)
        put_rate = samples / (time.perf_counter() - start)
        stats = _latencies_ms(lambda: client.stats(job), args.calls)
        client.close()
        with rpc.channel(address, "replay") as ch:
            stub = health_pb2_grpc.HealthStub(ch)
            stub.Check(check, timeout=10)
            health = _latencies_ms(lambda: stub.Check(check, timeout=10), args.calls)

        def connect() -> None:
            with rpc.channel(address, "replay") as fresh:
                health_pb2_grpc.HealthStub(fresh).Check(check, timeout=10,
                                                        wait_for_ready=True)

        connects = _latencies_ms(connect, args.connects)
    return {"mode": mode, "put_samples_per_s": put_rate,
            "get_stats_p50_ms": statistics.median(stats), "get_stats_p99_ms": percentile(stats, 0.99),
            "health_p50_ms": statistics.median(health), "health_p99_ms": percentile(health, 0.99),
            "connect_p50_ms": statistics.median(connects)}


def _as_rollout_worker(jobs: list[str], client_factory) -> None:
    """Put each job on the buffer with the scheduler's signed call (as placement
    does), hand this process a rollout pass for each, then drop the signing keys:
    from here on its calls are a rollout worker's, pass only."""
    from reflow import capabilities
    from reflow.core.grants import JOB_TOKENS

    key = rpcauth.credentials().signing["scheduler"]
    for job in jobs:
        client = client_factory()
        client.configure(job, ReplayConfig(replay_cap=0.5, max_staleness=2))
        client.close()
        JOB_TOKENS.grant(job, capabilities.issue_pass(key, job, "rollout"))
    for env in rpcauth.SIGNING_KEY_ENVS.values():
        os.environ.pop(env, None)
        os.environ.pop(f"{env}_FILE", None)
    rpcauth.reset_credentials()


def report(runs: list[dict]) -> dict:
    keys = [k for k in runs[0] if k != "mode"]
    summary = {mode: {k: statistics.median(r[k] for r in runs if r["mode"] == mode)
                      for k in keys} for mode in MODES}
    ratio = {k: summary["mutual TLS"][k] / summary["plaintext"][k] for k in keys}
    print(f"{'mode':<11} {'put samples/s':>14} {'GetStats p50':>13} {'p99 ms':>8} "
          f"{'health p50':>11} {'p99 ms':>8} {'connect p50 ms':>15}")
    for mode in MODES:
        s = summary[mode]
        print(f"{mode:<11} {s['put_samples_per_s']:>14,.0f} {s['get_stats_p50_ms']:>13.3f} "
              f"{s['get_stats_p99_ms']:>8.3f} {s['health_p50_ms']:>11.3f} "
              f"{s['health_p99_ms']:>8.3f} {s['connect_p50_ms']:>15.3f}")
    print(f"{'TLS/plain':<11} {ratio['put_samples_per_s']:>13.2f}x "
          f"{ratio['get_stats_p50_ms']:>12.2f}x {ratio['get_stats_p99_ms']:>7.2f}x "
          f"{ratio['health_p50_ms']:>10.2f}x {ratio['health_p99_ms']:>7.2f}x "
          f"{ratio['connect_p50_ms']:>14.2f}x")
    return {"summary": summary, "tls_over_plaintext": ratio}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--put-samples", type=int, default=32_768,
                        help="samples put per turn (the default: a few seconds of puts)")
    parser.add_argument("--put-chunk-groups", type=int, default=16,
                        help="groups per Put call, as a rollout worker batches them")
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--calls", type=int, default=2000, help="unary calls per turn, each kind")
    parser.add_argument("--connects", type=int, default=50, help="new connections per turn")
    parser.add_argument("--repeats", type=int, default=3, help="turns per mode, alternating")
    args = parser.parse_args()
    for name in ("put_samples", "put_chunk_groups", "group_size", "calls", "connects",
                 "repeats"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')}: at least 1")

    from reflow.procs import tune_gc
    from reflow.replay.client import GrpcReplayClient

    # This run's gRPC credential and signing keys; the buffers get the public ones.
    rpcauth.ensure_local_credentials()
    tune_gc()  # the GC settings every `reflow serve` process has
    started = time.monotonic()
    runs: list[dict] = []
    with tempfile.TemporaryDirectory(prefix="tls-cost-") as tmp:
        root = Path(tmp)
        certs = tlscerts.mint(root / "tls")
        redis = EmbeddedRedis(root / "redis").start()
        buffers = {}
        try:
            for mode in MODES:
                buffers[mode] = _start_buffer(mode, certs, redis.url, root)
            jobs = {(mode, r): f"tls-cost-{uuid.uuid4().hex[:8]}" for mode in MODES
                    for r in range(args.repeats)}
            # Granted through the plaintext buffer: grants live in the Redis both share.
            address = buffers["plaintext"][1]
            with _client_env("plaintext", certs):
                _as_rollout_worker(list(jobs.values()), lambda: GrpcReplayClient(address))
            for r in range(args.repeats):
                for mode in (MODES if r % 2 == 0 else MODES[::-1]):
                    runs.append(measure(mode, certs, buffers[mode][1], jobs[(mode, r)], args))
        finally:
            for proc, _ in buffers.values():
                procs.stop_gracefully(proc, timeout_s=10)
            redis.stop()
    result = report(runs)
    result.update(runs=runs, settings={k: v for k, v in vars(args).items() if k != "out"},
                  wall_s=time.monotonic() - started)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out} ({result['wall_s']:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
