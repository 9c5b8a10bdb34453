"""Per-rank memory and step time of the trainer group, replicated (trainer/dp.py)
against FSDP-sharded (trainer/fsdp.py), at 1, 2 and 3 ranks.

    python bench/fsdp_memory.py --out bench/out/fsdp_memory.json \\
        [--model tiny|PATH] [--ranks 1,2,3] [--steps 3] [--batch 12] [--seq 128]

Each configuration is a fresh group of processes on loopback gloo, one thread a
rank, so one's peak resident set (`ru_maxrss`) never hides another's. A rank
reports its peak RSS (the interpreter, torch and transformers included, the
same in every column), the bytes of parameters, gradients and AdamW moments it
holds after the last step (its shards under FSDP, all of it replicated), and
its median step time after one warm-up step. The batch is synthetic (random
ids, a long-tailed mix of response lengths up to `--seq`); both modes train the
same batches with the same micro-batch budget. `--model tiny` builds the
offline tiny-qwen3; a path is a Hugging Face model directory (for SmolLM2-135M:
`python -m reflow.cli models import-gguf`, then
`--model .reflow/models/smollm2-135m-instruct`).
"""

from __future__ import annotations

import argparse
import json
import random
import resource
import statistics
import subprocess  # nosec B404 # runs this script again, with fixed arguments
import sys
import tempfile
import time
from pathlib import Path

# The rendezvous key the ranks this script starts share (a job's leader draws one
# per group and hands it out by RPC; here every rank is a child of one run).
BENCH_RENDEZVOUS_KEY = "be" * 16

REPO = Path(__file__).resolve().parents[1]


def _batches(vocab: int, n: int, size: int, seq: int):
    from reflow.core.types import Segment, Trajectory

    rng = random.Random(0)
    out = []
    for step in range(n):
        batch = []
        for i in range(size):
            r = min(seq - 8, max(1, int(rng.lognormvariate(3.0, 1.0))))
            batch.append(Trajectory(
                sample_id=f"s{step}-{i}", group_id=f"g{i // 4}",
                prompt_ids=[rng.randrange(vocab) for _ in range(8)],
                response_ids=[rng.randrange(vocab) for _ in range(r)],
                logprobs=[-1.0] * r, loss_mask=[1] * r, segments=[Segment(0, r)],
                advantage=rng.uniform(-1, 1)))
        out.append(batch)
    return out


def _held_bytes(params, optimizer) -> int:
    from torch.distributed.tensor import DTensor

    def local(t):
        return t.to_local() if isinstance(t, DTensor) else t

    held = 0
    for p in params:
        held += local(p).numel() * local(p).element_size()
        if p.grad is not None:
            held += local(p.grad).numel() * local(p.grad).element_size()
    for state in optimizer.state.values():
        for v in state.values():
            if hasattr(v, "dim") and v.dim() > 0:
                held += local(v).numel() * local(v).element_size()
    return held


def _rss_now() -> int:
    """This process's resident bytes now (/proc: Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def run_rank(args: argparse.Namespace) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from reflow.core.config import parse_job_spec
    from reflow.trainer.step import compute_step

    torch.set_num_threads(1)
    torch.manual_seed(0)
    cpu = torch.device("cpu")
    spec = parse_job_spec({"model": {"path": args.model}})
    phases = {"start": _rss_now()}
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,  # nosec B615
                                                 local_files_only=True)
    phases["loaded"] = _rss_now()
    batches = _batches(model.config.vocab_size, args.steps + 1, args.batch, args.seq)
    group = None
    if args.mode == "fsdp":
        from reflow.trainer import fsdp

        group = fsdp.ShardedGroup.build("127.0.0.1", args.port, args.rank, args.world, cpu,
                                        rendezvous_key=BENCH_RENDEZVOUS_KEY)
        model = fsdp.shard_policy(model, group.mesh, cpu)
    elif args.world > 1:
        from reflow.trainer.dp import TrainerGroup

        group = TrainerGroup.build("127.0.0.1", args.port, args.rank, args.world, 0, cpu, 600.0,
                                   rendezvous_key=BENCH_RENDEZVOUS_KEY)
    phases["sharded" if args.mode == "fsdp" else "grouped"] = _rss_now()
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec.trainer.learning_rate)
    times = []
    for i, batch in enumerate(batches):
        t0 = time.perf_counter()
        compute_step(model, optimizer, spec, batch, 0, cpu, group=group)
        if i:  # the first is warm-up
            times.append(time.perf_counter() - t0)
        phases[f"step{i + 1}"] = _rss_now()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    report = {"rank": args.rank, "peak_rss_bytes": peak, "held_bytes": _held_bytes(
        list(model.parameters()), optimizer), "step_s": statistics.median(times),
        # Resident bytes after each phase (not peaks): where the peak was reached.
        "rss_after_bytes": phases}
    Path(args.report).write_text(json.dumps(report))
    if args.mode == "fsdp":
        group.close()


def run_group(model: str, mode: str, world: int, args: argparse.Namespace, tmp: Path) -> dict:
    from reflow.procs import free_port

    port = free_port()
    reports = [tmp / f"{mode}-{world}-{r}.json" for r in range(world)]
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", str(r), "--world", str(world),  # nosec B603
                               "--port", str(port), "--mode", mode, "--model", model,
                               "--report", str(reports[r]), "--steps", str(args.steps),
                               "--batch", str(args.batch), "--seq", str(args.seq)])
             for r in range(world)]
    for p in procs:
        if p.wait() != 0:
            raise SystemExit(f"{mode} at {world} ranks failed")
    ranks = [json.loads(r.read_text()) for r in reports]
    return {"peak_rss_bytes": max(r["peak_rss_bytes"] for r in ranks),
            "held_bytes": max(r["held_bytes"] for r in ranks),
            "step_s": max(r["step_s"] for r in ranks), "ranks": ranks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--ranks", default="1,2,3")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--batch", type=int, default=12)
    parser.add_argument("--seq", type=int, default=128)
    # One rank of a group (this script run again by run_group).
    parser.add_argument("--rank", type=int, default=-1)
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--mode", default="replicate")
    parser.add_argument("--report", default="")
    args = parser.parse_args(argv)
    if args.rank >= 0:
        run_rank(args)
        return 0
    if args.out is None:
        parser.error("--out is required")
    worlds = [int(w) for w in args.ranks.split(",")]
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model == "tiny":
            from reflow.models.tiny import build_tiny_qwen3

            model = str(build_tiny_qwen3(Path(tmp) / "tiny-qwen3", seed=0))
        for world in worlds:  # interleaved: each world size runs both modes in turn
            for mode in ("replicate", "fsdp"):
                results[f"{mode}@{world}"] = run_group(model, mode, world, args, Path(tmp))
    print(f"{'mode':<11}{'ranks':>6}{'peak RSS MB':>13}{'state MB':>10}{'vs repl.':>10}"
          f"{'step s':>8}")
    for world in worlds:
        for mode in ("replicate", "fsdp"):
            r = results[f"{mode}@{world}"]
            base = results[f"replicate@{world}"]
            print(f"{mode:<11}{world:>6}{r['peak_rss_bytes'] / 2**20:>13.0f}"
                  f"{r['held_bytes'] / 2**20:>10.1f}"
                  f"{r['peak_rss_bytes'] / base['peak_rss_bytes']:>10.2f}{r['step_s']:>8.3f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"model": args.model, "batch": args.batch, "seq": args.seq,
                                    "steps": args.steps, "results": results}, indent=2))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
