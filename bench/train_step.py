"""Trainer step time against the micro-batch token budget
(`trainer.max_tokens_per_micro_batch`), on the tiny model, one thread (the trainer's
share of a two-core machine), for the benchmark job's batch shapes.

    python bench/train_step.py --out bench/out/train_step.json [--reps 7] [--threads 1]

Two length mixes of 64 responses: `task`, the token lengths of the repeat task's correct
responses under the model's own tokenizer (its Zipf counts up to `task.max_count`, the
symbol that many times and EOS, capped at `rollout.max_tokens`); `uniform`, 1 to
`rollout.max_tokens` (an untrained policy's). Budgets are timed interleaved (one rep
of each, then the next), and the table gives the median step time and its ratio to
the whole batch in one pass.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from reflow.core.config import load_job_spec
from reflow.core.types import Batch, Segment, Trajectory
from reflow.models.tiny import build_tiny_qwen3
from reflow.tasks.repeat import RepeatTask
from reflow.trainer.loop import TrainLoop

REPO = Path(__file__).resolve().parents[1]
BUDGETS = (None, 4096, 2048, 1024, 512)


class _NoReplay:
    def configure(self, job_id, config):
        pass


def batch_of(lengths: list[int], vocab: int, rng: random.Random) -> Batch:
    trajectories = [Trajectory(
        sample_id=f"s{i}", group_id=f"g{i // 8}", prompt_ids=[rng.randrange(vocab) for _ in range(6)],
        response_ids=[rng.randrange(vocab) for _ in range(n)],
        logprobs=[-1.0] * n, loss_mask=[1] * n, segments=[Segment(0, n)],
        advantage=rng.uniform(-1, 1)) for i, n in enumerate(lengths)]
    return Batch(lease_id="bench", trajectories=trajectories)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--config", default=str(REPO / "examples" / "bench_modes.yaml"))
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    base = load_job_spec(args.config)
    rng = random.Random(0)
    task = RepeatTask(**base.task.args)
    cap, b = base.rollout.max_tokens, base.trainer.batch_size
    results: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        model = build_tiny_qwen3(Path(tmp) / "tiny-qwen3", seed=0)
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model, local_files_only=True)  # nosec B615

        def answer_tokens(count: int) -> int:  # "c c ... c" then EOS
            return len(tokenizer(" ".join(["c"] * count)).input_ids) + 1

        mixes = {"task": [min(answer_tokens(task.sample_count()), cap) for _ in range(b)],
                 "uniform": [rng.randint(1, cap) for _ in range(b)]}
        loops = {}
        for budget in BUDGETS:
            spec = base.model_copy(deep=True)
            spec.model.path = str(model)
            spec.trainer.max_tokens_per_micro_batch = budget
            loops[budget] = TrainLoop("bench", spec, _NoReplay(), rollouts=[],
                                      device=torch.device("cpu"))
            loops[budget].load()
        vocab = loops[None].model.config.vocab_size
        for mix, lengths in mixes.items():
            batch = batch_of(lengths, vocab, rng)
            times: dict = {budget: [] for budget in BUDGETS}
            for rep in range(args.reps + 1):
                for budget in BUDGETS:
                    t0 = time.perf_counter()
                    loops[budget]._train_step(batch)
                    if rep:  # the first is warm-up
                        times[budget].append(time.perf_counter() - t0)
            whole = statistics.median(times[None])
            padded = len(lengths) * (max(lengths) + 6)
            results[mix] = {"response_tokens": sum(lengths), "padded_tokens_whole_batch": padded,
                            "budgets": {str(k): {"median_s": statistics.median(v), "min_s": min(v),
                                                 "max_s": max(v),
                                                 "vs_whole_batch": statistics.median(v) / whole}
                                        for k, v in times.items()}}
    print(f"{'mix':<9}{'budget':>8}{'median s':>10}{'min-max s':>16}{'vs whole':>10}")
    for mix, r in results.items():
        for budget, t in r["budgets"].items():
            print(f"{mix:<9}{budget:>8}{t['median_s']:>10.3f}"
                  f"{t['min_s']:>8.3f}-{t['max_s']:.3f}{t['vs_whole_batch']:>10.2f}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"threads": args.threads, "mixes": results}, indent=2))
    print(f"\nresults: {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
