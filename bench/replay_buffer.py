"""Replay-buffer throughput and latency on the embedded Redis.

    python bench/replay_buffer.py --out bench/out/replay_buffer.json
    python bench/replay_buffer.py --appendfsync everysec,always --out bench/out/replay_aof.json

Measures (1) put throughput: GRPO groups put the way a rollout worker puts
them, in samples/s; (2) the latency of composing and leasing a batch of 256
(σ = 0.5, uniform sampler) while the pools turn over as in training: each
round puts fresh groups, leases a batch, releases it into the replay pool,
and every few rounds publishes a version that evicts what grew too stale.
The headline goes through the ReplayStore (Redis round trips, Lua, decoding
to Trajectory objects) in one process with the GC settings `reflow serve`
uses; `--grpc` adds the same figures through a loopback gRPC server, which is
what the trainer sees. `--appendfsync` runs it all once per fsync policy of the
append-only file, each on a fresh embedded Redis (in `--data-dir`: fsync costs
what that disk makes it cost), to price `always` against `everysec`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from reflow.core.config import ReplayConfig
from reflow.core.types import Segment, Trajectory
from reflow.replay.embedded import EmbeddedRedis, check_appendfsync
from reflow.replay.store import ReplayStore


def make_groups(num_groups: int, group_size: int, prompt_tokens: int, response_tokens: int,
                version: int, salt: str) -> list[Trajectory]:
    out = []
    for g in range(num_groups):
        gid = f"{salt}{g}"
        for i in range(group_size):
            out.append(Trajectory(
                f"{gid}-{i}", gid, list(range(prompt_tokens)), list(range(response_tokens)),
                [-0.5] * response_tokens, [1] * response_tokens, [Segment(version, response_tokens)],
                reward=float(i % 2), advantage=float(i % 2) - 0.5, created_at=time.time()))
    return out


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def bench_put(client, job: str, args) -> float:
    chunk = args.put_chunk_groups
    batches = [make_groups(chunk, args.group_size, args.prompt_tokens, args.response_tokens, 0,
                           f"p{k}-") for k in range(args.put_samples // (chunk * args.group_size))]
    start = time.perf_counter()
    n = sum(client.put(job, b) for b in batches)
    return n / (time.perf_counter() - start)


def bench_sample(client, job: str, args) -> list[float]:
    latencies = []
    version = 0
    for r in range(args.rounds):
        client.put(job, make_groups(args.batch_size // (2 * args.group_size), args.group_size,
                                    args.prompt_tokens, args.response_tokens, version, f"s{r}-"))
        start = time.perf_counter()
        batch = client.sample(job, args.batch_size, 60.0, 5.0)
        latencies.append((time.perf_counter() - start) * 1000)
        assert batch is not None and len(batch.trajectories) == args.batch_size
        client.release(job, batch.lease_id)
        if r % 4 == 3:
            version += 1
            client.publish_version(job, version)
    return latencies[args.warmup:]


def run(client, label: str, appendfsync: str, args) -> dict:
    job = f"bench-{uuid.uuid4().hex[:8]}"
    client.configure(job, ReplayConfig(replay_cap=0.5, max_staleness=2))
    put_rate = bench_put(client, job, args)
    # Start the sampling phase with the pools warm: one batch worth of unused samples.
    client.put(job, make_groups(args.batch_size // args.group_size, args.group_size,
                                args.prompt_tokens, args.response_tokens, 0, "warm-"))
    lat = bench_sample(client, job, args)
    return {
        "path": label,
        "appendfsync": appendfsync,
        "put_samples_per_s": put_rate,
        "sample_b256_p50_ms": statistics.median(lat),
        "sample_b256_p99_ms": percentile(lat, 0.99),
        "sample_b256_mean_ms": statistics.fmean(lat),
        "num_sample_rounds": len(lat),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="JSON file to write")
    parser.add_argument("--put-samples", type=int, default=40_960)
    parser.add_argument("--put-chunk-groups", type=int, default=32)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=64)
    parser.add_argument("--response-tokens", type=int, default=128)
    parser.add_argument("--batch-size", type=int, default=256)
    parser.add_argument("--rounds", type=int, default=220)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument("--grpc", action="store_true", help="also measure through gRPC")
    parser.add_argument("--appendfsync", default="everysec",
                        help="fsync policies of Redis's append-only file to measure, comma "
                        "separated (everysec, always); the first is the headline")
    parser.add_argument("--data-dir", default=None,
                        help="where each Redis keeps its append-only file (default: a temp dir)")
    args = parser.parse_args()
    from reflow import rpcauth

    # gRPC secrets (reflow.rpcauth): the runs started here inherit them, and this
    # process's own calls to their services carry them.
    rpcauth.ensure_local_credentials()
    try:
        modes = [check_appendfsync(m.strip(), "--appendfsync")
                 for m in args.appendfsync.split(",")]
    except ValueError as err:
        parser.error(str(err))

    from reflow.procs import tune_gc
    from reflow.replay.client import GrpcReplayClient, InprocReplayClient
    from reflow.replay.server import serve

    # The GC settings `reflow serve` applies to every service process.
    tune_gc()

    results = []
    for mode in modes:
        with tempfile.TemporaryDirectory(dir=args.data_dir) as tmp:
            redis = EmbeddedRedis(tmp, appendfsync=mode).start()
            try:
                store = ReplayStore.from_url(redis.url)
                results.append(run(InprocReplayClient(store), "store", mode, args))
                if args.grpc:
                    server, port = serve(store, "127.0.0.1:0")
                    client = GrpcReplayClient(f"127.0.0.1:{port}")
                    results.append(run(client, "grpc", mode, args))
                    client.close()
                    server.stop(0)
            finally:
                redis.stop()

    print(f"{'path':<6} {'appendfsync':<11} {'put samples/s':>14} {'vs first':>8} "
          f"{'b256 p50 ms':>12} {'b256 p99 ms':>12} {'mean ms':>8}")
    for r in results:
        base = next(b for b in results if b["path"] == r["path"])
        print(f"{r['path']:<6} {r['appendfsync']:<11} {r['put_samples_per_s']:>14,.0f} "
              f"{r['put_samples_per_s'] / base['put_samples_per_s']:>7.2f}x "
              f"{r['sample_b256_p50_ms']:>12.2f} {r['sample_b256_p99_ms']:>12.2f} "
              f"{r['sample_b256_mean_ms']:>8.2f}")
    headline = {k: results[0][k] for k in ("put_samples_per_s", "sample_b256_p50_ms", "sample_b256_p99_ms")}
    headline["runs"] = results
    headline["settings"] = {k: v for k, v in vars(args).items() if k != "out"}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(headline, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
