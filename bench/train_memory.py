"""Peak trainer memory and step time of one optimizer step on SmolLM2-135M-Instruct,
for the ways the trainer can score tokens:

- `full_logits`: `trainer.logprob_chunk_tokens=None`, the model's full [B, T, V]
  logits per micro-batch and a float32 copy of them (the trainer before chunking);
- `chunked`: log-probabilities from the last hidden states, `--chunk` positions at
  a time, each chunk's logits recomputed in the backward pass;
- `chunked_ckpt`: chunked, plus `trainer.activation_checkpointing`;
- `chunked_kl` (with `--with-kl`): chunked, plus a KL penalty, so the frozen
  reference model's memory and extra forward show.

    python -m reflow.cli models import-gguf      # once: .reflow/models/smollm2-135m-instruct
    nice -n 10 python bench/train_memory.py --out bench/out/train_memory.json \\
        [--batch 64] [--seq 512] [--threads 2]

Each configuration runs in a fresh subprocess, so one's peak resident set size
(`ru_maxrss`: model, AdamW state, gradients and activations together) never
hides another's. The batch is synthetic (random token ids, prompt of `--prompt`
tokens, the rest response, GRPO fields filled) and cut into micro-batches by the
default `trainer.max_tokens_per_micro_batch`, so peak memory follows the
micro-batch, not the batch: a smaller `--batch` changes the step time, not the peak.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import resource
import subprocess  # nosec B404 # runs this script again, with fixed arguments
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
DEFAULT_MODEL = REPO / ".reflow" / "models" / "smollm2-135m-instruct"
CONFIGS = {
    "full_logits": {"logprob_chunk_tokens": None},
    "chunked": {},
    "chunked_ckpt": {"activation_checkpointing": True},
    "chunked_kl": {"kl_coef": 0.05},
}


class _NoReplay:
    def configure(self, job_id, config):
        pass


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def run_one(name: str, args: argparse.Namespace) -> dict:
    """One configuration, in this (fresh) process: load, one step, measure."""
    import torch

    from reflow.core.config import parse_job_spec
    from reflow.core.types import Batch, Segment, Trajectory
    from reflow.trainer.loop import TrainLoop

    trainer = {"logprob_chunk_tokens": args.chunk,
               **CONFIGS[name]}
    spec = parse_job_spec({"model": {"path": str(args.model), "dtype": "float32"},
                           "trainer": trainer})
    loop = TrainLoop("bench", spec, _NoReplay(), rollouts=[], device=torch.device("cpu"))
    loop.load()
    torch.set_num_threads(args.threads)
    loaded_rss = _rss_bytes()
    rng = random.Random(0)
    vocab = loop.model.config.vocab_size
    response = args.seq - args.prompt
    trajectories = [Trajectory(
        sample_id=f"s{i}", group_id=f"g{i // 8}",
        prompt_ids=[rng.randrange(vocab) for _ in range(args.prompt)],
        response_ids=[rng.randrange(vocab) for _ in range(response)],
        logprobs=[-rng.uniform(0.5, 8.0) for _ in range(response)], loss_mask=[1] * response,
        segments=[Segment(0, response)], advantage=rng.uniform(-1.5, 1.5))
        for i in range(args.batch)]
    started = time.perf_counter()
    (stats, grad_norm), _ = loop._train_step(Batch(lease_id="bench", trajectories=trajectories))
    step_s = time.perf_counter() - started
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"config": name, "trainer": trainer,
            "max_tokens_per_micro_batch": spec.trainer.max_tokens_per_micro_batch,
            "step_s": step_s, "peak_rss_bytes": peak,
            "loaded_rss_bytes": loaded_rss, "reference_model_bytes": loop.reference_bytes,
            "loss": stats.loss, "kl": stats.kl, "grad_norm": grad_norm,
            "num_parameters": sum(p.numel() for p in loop.model.parameters())}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "train_memory.json")
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="an imported model directory (reflow models import-gguf)")
    parser.add_argument("--batch", type=int, default=64, help="sequences in the step")
    parser.add_argument("--seq", type=int, default=512, help="tokens per sequence")
    parser.add_argument("--prompt", type=int, default=64, help="prompt tokens per sequence")
    parser.add_argument("--chunk", type=int, default=1024, help="trainer.logprob_chunk_tokens "
                        "of the chunked configurations")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--configs", default="full_logits,chunked,chunked_ckpt")
    parser.add_argument("--with-kl", action="store_true", help="also run chunked_kl")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(run_one(args.child, args)))
        return 0
    if not (args.model / "config.json").exists():
        raise SystemExit(f"{args.model} holds no model: run `reflow models import-gguf` first")
    names = [n for n in args.configs.split(",") if n] + (["chunked_kl"] if args.with_kl else [])
    unknown = sorted(set(names) - set(CONFIGS))
    if unknown:
        raise SystemExit(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    passthrough = ["--model", str(args.model), "--batch", str(args.batch), "--seq", str(args.seq),
                   "--prompt", str(args.prompt), "--chunk", str(args.chunk),
                   "--threads", str(args.threads)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    results = []
    for name in names:
        done = subprocess.run(  # nosec B603 # this script, fixed arguments
            [sys.executable, __file__, "--child", name, *passthrough], env=env,
            capture_output=True, text=True, check=False)
        if done.returncode != 0:
            sys.stderr.write(done.stderr[-4000:])
            raise SystemExit(f"{name}: exit {done.returncode}")
        results.append(json.loads(done.stdout.strip().splitlines()[-1]))
        r = results[-1]
        print(f"  {name}: {r['step_s']:.1f} s, peak {r['peak_rss_bytes'] / 2**30:.2f} GiB",
              flush=True)
    base = results[0]["peak_rss_bytes"]
    print(f"\n{args.batch} x {args.seq} tokens, micro-batches of "
          f"{results[0]['max_tokens_per_micro_batch']} tokens, {args.threads} threads, float32")
    print(f"{'config':<14}{'step s':>9}{'peak RSS GiB':>14}{'after load GiB':>16}"
          f"{'vs first':>10}{'loss':>10}")
    for r in results:
        print(f"{r['config']:<14}{r['step_s']:>9.1f}{r['peak_rss_bytes'] / 2**30:>14.2f}"
              f"{r['loaded_rss_bytes'] / 2**30:>16.2f}{r['peak_rss_bytes'] / base:>10.2f}"
              f"{r['loss']:>10.4f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"batch": args.batch, "seq": args.seq, "prompt": args.prompt,
                                    "threads": args.threads, "results": results}, indent=2))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
