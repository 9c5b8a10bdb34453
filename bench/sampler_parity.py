"""Do ReFlow's engine and Hugging Face `generate` draw the same responses? The same
prompts, the same weights (the job's model.path: the initial ones, or a trained
run's exported model), many samples each, compared by what training
sees: reward, response length and how often the model stops by itself.

    python bench/sampler_parity.py examples/math.yaml --out DIR --prompts 16 --samples 32 \
        [section.field=value ...]

ReFlow's side is its rollout engine (rollout.vllm_engine.VllmEngine, the sampling
parameters a rollout worker sends); the other is `model.generate` with the options
TRL's GRPOTrainer passes when it generates without vLLM (do_sample, temperature,
top_p 1, top_k 0, max_new_tokens, the tokenizer's EOS). Prompts are rendered as a
rollout worker renders them (tasks.chat.ChatRenderer) and fed to both as tokens.
Rewards are the task's own, on the text decoded without special tokens.

Beside them, a far finer check: the trainer's per-token negative log-likelihood of
each sampler's responses (trainer.step.sequence_logprobs, the law the engine samples
from: softmax(logits / T), in float32 on the same weights). Two samplers with one law
give responses of the same expected NLL a token (the law's entropy rate), and a paired
difference over prompts resolves a few thousandths of a nat where reward, a 0/1 score,
resolves a few hundredths.

Prints a table (mean with a 95 % interval over prompts, and the paired difference)
and writes DIR/sampler_parity.json.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services"))
sys.path.insert(0, str(REPO / "bench"))


def _interval(values: list[float]) -> tuple[float, float, float]:
    """Mean and a 95 % t-interval over the prompts."""
    import numpy as np

    from convergence_stats import t_interval

    mean, low, high = t_interval(np.asarray(values, dtype=float))
    return float(mean), float(low), float(high)


METRICS = ("reward", "length", "stopped", "nll")


def _summarise(per_prompt: list[dict]) -> dict:
    return {key: _interval([p[key] for p in per_prompt]) for key in METRICS}


def _per_prompt(samples: list[tuple[float, int, bool]], nll: float) -> dict:
    return {"reward": statistics.fmean(s[0] for s in samples),
            "length": statistics.fmean(s[1] for s in samples),
            "stopped": statistics.fmean(float(s[2]) for s in samples), "nll": nll}


def _trainer_nll(model, prompt_ids: list[int], responses: list[list[int]],
                 temperature: float, pad_id: int) -> float:
    """The trainer's mean negative log-likelihood a response token over one prompt's
    samples (tokens pooled: a long response weighs by its length)."""
    import torch

    from reflow.trainer.step import sequence_logprobs

    rows = [prompt_ids + r for r in responses if r]
    if not rows:
        return float("nan")
    width = max(len(r) for r in rows)
    ids = torch.tensor([r + [pad_id] * (width - len(r)) for r in rows])
    mask = torch.tensor([[1] * len(r) + [0] * (width - len(r)) for r in rows])
    with torch.no_grad():
        logprobs = sequence_logprobs(model, ids, mask, temperature, chunk_tokens=None)
    # Position t scores token t + 1: the response tokens are positions len(prompt) - 1 on.
    start = len(prompt_ids) - 1
    keep = mask[:, 1:].clone().float()
    keep[:, :start] = 0.0
    return float(-(logprobs * keep).sum() / keep.sum())


async def _engine_samples(model_dir: str, spec, prompt_ids: list[list[int]], n: int,
                          stops: frozenset[int]) -> list[list[tuple[list[int], bool]]]:
    from reflow.rollout.engine import SamplingSpec
    from reflow.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(model_dir, dtype=spec.model.dtype, kv_cache_gb=spec.rollout.kv_cache_gb,
                        seed=spec.seed)
    sampling = SamplingSpec(max_tokens=spec.rollout.max_tokens,
                            temperature=spec.rollout.temperature)

    async def one(i: int, j: int) -> tuple[list[int], bool]:
        ids: list[int] = []
        async for delta in engine.generate(f"p{i}-s{j}", prompt_ids[i], sampling):
            ids.extend(delta.token_ids)
        return ids, bool(ids) and ids[-1] in stops

    try:
        rows = []
        for i in range(len(prompt_ids)):
            rows.append(list(await asyncio.gather(*(one(i, j) for j in range(n)))))
        return rows
    finally:
        engine.shutdown()


def _hf_samples(model_dir: str, spec, prompt_ids: list[list[int]], n: int, tokenizer,
                stops: frozenset[int]) -> list[list[tuple[list[int], bool]]]:
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    torch.manual_seed(spec.seed)
    model = AutoModelForCausalLM.from_pretrained(  # nosec B615 # local dir only
        model_dir, dtype=torch.float32, local_files_only=True).eval()
    config = GenerationConfig(
        max_new_tokens=spec.rollout.max_tokens, do_sample=True,
        temperature=spec.rollout.temperature, top_p=1.0, top_k=0, min_p=None,
        repetition_penalty=1.0, pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    rows = []
    with torch.no_grad():
        for ids in prompt_ids:
            prompt = torch.tensor([ids] * n)
            out = model.generate(prompt, attention_mask=torch.ones_like(prompt),
                                 generation_config=config)[:, len(ids):].tolist()
            row = []
            for seq in out:
                # Up to and including the first EOS, as TRL cuts its completions.
                cut = next((k + 1 for k, t in enumerate(seq) if t == tokenizer.eos_token_id),
                           len(seq))
                seq = seq[:cut]
                row.append((seq, bool(seq) and seq[-1] in stops))
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a ReFlow job spec (YAML)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--samples", type=int, default=32, help="samples per prompt")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    args = parser.parse_intermixed_args(argv)

    from transformers import AutoTokenizer

    from reflow.core.config import load_job_spec
    from reflow.models.tiny import ensure_model
    from reflow.tasks import ChatTask, build_task
    from reflow.tasks.chat import ChatRenderer

    spec = load_job_spec(args.config, args.overrides)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    model_dir = str(ensure_model(spec.model.path, spec.model.build_if_missing, seed=spec.seed))
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)  # nosec B615
    task = build_task(spec)
    stream = task.prompts()
    prompts = [next(stream) for _ in range(args.prompts)]
    renderer = ChatRenderer(tokenizer)
    prompt_ids = [renderer.prompt_ids(task.prompt_messages(p)) if isinstance(task, ChatTask)
                  else tokenizer.encode(p.text, add_special_tokens=False) for p in prompts]

    timings = {}
    started = time.monotonic()
    engine_rows = asyncio.run(_engine_samples(model_dir, spec, prompt_ids, args.samples,
                                              renderer.stop_token_ids))
    timings["engine_s"] = time.monotonic() - started
    started = time.monotonic()
    hf_rows = _hf_samples(model_dir, spec, prompt_ids, args.samples, tokenizer,
                          renderer.stop_token_ids)
    timings["hf_generate_s"] = time.monotonic() - started

    import torch
    from transformers import AutoModelForCausalLM

    trainer_model = AutoModelForCausalLM.from_pretrained(  # nosec B615 # local dir only
        model_dir, dtype=torch.float32, local_files_only=True).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0

    def scored(rows):
        return [_per_prompt([(float(task.reward(p, tokenizer.decode(ids, skip_special_tokens=True))),
                              len(ids), stopped) for ids, stopped in row],
                            _trainer_nll(trainer_model, pids, [ids for ids, _ in row],
                                         spec.rollout.temperature, pad_id))
                for p, pids, row in zip(prompts, prompt_ids, rows)]

    engine, hf = scored(engine_rows), scored(hf_rows)
    diffs = [{k: e[k] - h[k] for k in e} for e, h in zip(engine, hf)]
    result = {"model": model_dir, "prompts": args.prompts, "samples_per_prompt": args.samples,
              "engine": _summarise(engine), "hf_generate": _summarise(hf),
              "engine_minus_hf": _summarise(diffs), **timings,
              "per_prompt": {"engine": engine, "hf_generate": hf}}
    (out / "sampler_parity.json").write_text(json.dumps(result, indent=2))
    print(f"{args.prompts} prompts x {args.samples} samples, weights {model_dir}; "
          "mean [95 % interval over prompts]")
    print("| sampler | reward | response tokens | stopped by itself | trainer NLL a token |\n"
          "|---|---|---|---|---|")
    for name, key in (("ReFlow engine (vLLM)", "engine"), ("HF generate (TRL)", "hf_generate"),
                      ("engine - HF, paired", "engine_minus_hf")):
        cells = " | ".join(f"{m:+.3f} [{lo:+.3f}, {hi:+.3f}]" if key == "engine_minus_hf"
                           else f"{m:.3f} [{lo:.3f}, {hi:.3f}]"
                           for m, lo, hi in (result[key][k] for k in METRICS))
        print(f"| {name} | {cells} |")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sys.exit(main())
