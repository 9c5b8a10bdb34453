"""TRL's GRPOTrainer on a ReFlow benchmark job: the single-process peer a CPU user
would try first, run on the same model, task and settings.

    make bench-trl-env      # bench/.venv-trl: trl and its own transformers pin
    bench/.venv-trl/bin/python bench/trl_grpo.py examples/bench_modes.yaml --out DIR \
        [section.field=value ...]

`reflow bench modes --with-trl` runs this beside the modes. It reads the same JobSpec
(YAML plus dotted overrides) that `reflow run` reads and maps it onto GRPOConfig with
TRL's own parameter names:

    ReFlow                          TRL GRPOConfig
    rollout.group_size              num_generations
    trainer.batch_size              per_device_train_batch_size (completions per step;
                                    gradient_accumulation_steps = steps_per_generation = 1)
    trainer.num_steps               max_steps
    trainer.learning_rate           learning_rate
    trainer.lr_schedule, warmup_steps, min_lr_ratio
                                    lr_scheduler_type constant_with_warmup / linear /
                                    cosine (cosine_with_min_lr with a floor),
                                    warmup_steps (`schedule_options`)
    trainer.weight_decay            weight_decay
    trainer.max_grad_norm           max_grad_norm
    trainer.clip_eps                epsilon
    rollout.max_tokens              max_completion_length
    rollout.temperature, top_p, top_k
                                    temperature, top_p, top_k (0: off in both)
    trainer.kl_coef (β, k3)         beta (use_bias_correction_kl off: ReFlow's KL term
                                    is not weighted by the ratio)
    algorithm.loss / loss_aggregation / clip_eps_high / advantage / overlong:
                                    loss_type, importance_sampling_level, epsilon_high,
                                    scale_rewards, mask_truncated_completions
                                    (`loss_options` below; a setting TRL has no
                                    counterpart for is refused, not dropped)
    seed                            seed; prompts in the task's seeded order (no shuffle)

Every loss option of GRPOConfig is set here, defaults included, so a TRL upgrade that
changes a default cannot change the comparison; the extras TRL has and ReFlow does not
(two-sided clip `delta`, entropy masking and bonus, off-policy masking, vLLM's
importance-sampling correction) are pinned off. `algorithm.proximal` and
`algorithm.importance_mode` need no counterpart: TRL generates with the very weights
it trains (Hugging Face `generate`, num_iterations 1), so the behaviour, proximal and
current policies coincide and every importance weight is 1.

One optimizer step per generated batch (num_iterations 1), as ReFlow's trainer takes
one step per batch. Generation is TRL's own (Hugging Face `generate`, no vLLM), on
every core of the machine (torch threads = cores). Differences we know of: TRL's
group std is the sample std (ReFlow's the population std).

Writes DIR/metrics.jsonl (one record per step, with the fields a ReFlow run writes
that apply: trained_tokens are response tokens; batch_wait_s is time spent
generating, during which the optimizer idles, as in ReFlow's sync mode) and
DIR/summary.json, including start-up (model load and trainer construction)
separately from the steady state.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The ReFlow spec, task and model builder: pure Python over pydantic and yaml, which
# this environment has; nothing of ReFlow's services is imported.
sys.path.insert(0, str(REPO / "services"))


# ReFlow's aggregation of token losses -> TRL's loss_type of the same normalisation.
LOSS_TYPES = {"token_mean": "dapo", "seq_mean_token_mean": "grpo",
              "seq_mean_token_sum_norm": "dr_grpo"}
# ReFlow's built-in losses TRL can run: (default aggregation, default ε_high or None for
# trainer.clip_eps, where the ratio is taken). gspo's sequence ratio is the geometric
# mean of its tokens' ratios in both.
LOSSES = {"grpo": ("token_mean", None, "token"), "dapo": ("token_mean", 0.28, "token"),
          "dr_grpo": ("seq_mean_token_sum_norm", None, "token"),
          "gspo": ("seq_mean_token_mean", None, "sequence")}
# ReFlow's advantage estimators -> scale_rewards. `grpo` divides by the group's
# population std and TRL by its sample std (the difference the docstring names).
SCALE_REWARDS = {"grpo": "group", "grpo_sample_std": "group", "mean_centered": "none"}


def loss_options(spec) -> dict:
    """GRPOConfig's loss options for the spec's trainer and algorithm sections, every
    one of them explicit. SystemExit names a setting TRL cannot run."""
    algo = spec.algorithm

    def refuse(field: str, value, allowed) -> SystemExit:
        return SystemExit(f"trl_grpo: {field}={value!r} has no TRL counterpart here "
                          f"(supported: {allowed})")

    if algo.loss not in LOSSES or algo.loss_args:
        raise refuse("algorithm.loss", algo.loss, f"{sorted(LOSSES)} without loss_args")
    default_aggregation, default_high, level = LOSSES[algo.loss]
    aggregation = algo.loss_aggregation or default_aggregation
    if aggregation == "seq_mean_token_sum_norm" and algo.aggregation_tokens not in (
            None, spec.rollout.max_tokens):
        # TRL's dr_grpo divides by max_completion_length.
        raise refuse("algorithm.aggregation_tokens", algo.aggregation_tokens,
                     "None or rollout.max_tokens")
    if algo.advantage_name not in SCALE_REWARDS:
        raise refuse("algorithm.advantage", algo.advantage_name, sorted(SCALE_REWARDS))
    if algo.dynamic_sampling:
        raise refuse("algorithm.dynamic_sampling", True, "false")
    if algo.overlong not in ("keep", "mask"):
        raise refuse("algorithm.overlong", algo.overlong, "keep, mask")
    high = algo.clip_eps_high if algo.clip_eps_high is not None else default_high
    return {
        "loss_type": LOSS_TYPES[aggregation],
        "importance_sampling_level": level,
        "epsilon": spec.trainer.clip_eps,
        "epsilon_high": spec.trainer.clip_eps if high is None else high,
        "delta": None,  # no two-sided clip
        "scale_rewards": SCALE_REWARDS[algo.advantage_name],
        "mask_truncated_completions": algo.overlong == "mask",
        "beta": spec.trainer.kl_coef,
        "use_bias_correction_kl": False,
        "sync_ref_model": False,
        "num_iterations": 1,
        "top_entropy_quantile": 1.0,  # every token in the loss
        "entropy_coef": 0.0,
        "use_adaptive_entropy": False,
        "off_policy_mask_threshold": None,
        "use_vllm": False,
        "vllm_importance_sampling_correction": False,  # no vLLM, nothing to correct
        "reward_weights": None,
        "multi_objective_aggregation": "sum_then_normalize",  # one reward function
        # The optimizer ReFlow's trainer builds: torch's AdamW at its defaults.
        "optim": "adamw_torch",
        "adam_beta1": 0.9,
        "adam_beta2": 0.999,
        "adam_epsilon": 1e-8,
    }


def schedule_options(trainer) -> dict:
    """GRPOConfig's learning-rate schedule for trainer.lr_schedule, warmup_steps and
    min_lr_ratio: Hugging Face's schedulers of the same laws (reflow.trainer.schedule),
    stepped once per optimizer step as ReFlow sets the rate. SystemExit names a
    setting they cannot run."""
    if trainer.lr_schedule == "constant":
        kind, kwargs = "constant_with_warmup", {}
    elif trainer.min_lr_ratio == 0.0:
        kind, kwargs = trainer.lr_schedule, {}
    elif trainer.lr_schedule == "cosine":
        kind, kwargs = "cosine_with_min_lr", {"min_lr_rate": trainer.min_lr_ratio}
    else:
        raise SystemExit(f"trl_grpo: trainer.min_lr_ratio={trainer.min_lr_ratio!r} with "
                         "lr_schedule=linear has no Hugging Face scheduler (supported: 0, or "
                         "lr_schedule cosine)")
    return {"lr_scheduler_type": kind, "lr_scheduler_kwargs": kwargs,
            "warmup_steps": trainer.warmup_steps}


def task_dataset(spec):
    """(task, prompts, dataset): the job's first num_steps x batch / group prompts,
    in the seeded order its dispatcher draws them, as TRL's train dataset. A chat
    task's prompts go as conversations: TRL renders them with the model's chat
    template, as ReFlow's rollout workers do."""
    from datasets import Dataset

    from reflow.tasks import ChatTask, build_task

    task = build_task(spec)
    stream = task.prompts()
    count = spec.trainer.num_steps * spec.trainer.batch_size // spec.rollout.group_size
    prompts = [next(stream) for _ in range(count)]
    chat = isinstance(task, ChatTask)
    dataset = Dataset.from_list([{"prompt": task.prompt_messages(p) if chat else p.text,
                                  "prompt_id": p.prompt_id, "answer": p.answer, "text": p.text}
                                 for p in prompts])
    return task, prompts, dataset


def grpo_config(spec, out: Path, loss: dict):
    """GRPOConfig for the spec: the mapping in the module docstring, `loss` from
    loss_options, one optimizer step per generated batch, on the CPU in fp32."""
    from trl import GRPOConfig

    return GRPOConfig(
        output_dir=str(out / "trl"),
        num_generations=spec.rollout.group_size,
        per_device_train_batch_size=spec.trainer.batch_size,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        max_steps=spec.trainer.num_steps,
        learning_rate=spec.trainer.learning_rate,
        **schedule_options(spec.trainer),
        weight_decay=spec.trainer.weight_decay,
        max_grad_norm=spec.trainer.max_grad_norm,
        **loss,
        max_completion_length=spec.rollout.max_tokens,
        temperature=spec.rollout.temperature,
        top_p=spec.rollout.top_p,
        top_k=spec.rollout.top_k,  # 0: off in both
        min_p=None,
        repetition_penalty=1.0,
        generation_kwargs=None,
        disable_dropout=False,  # ReFlow's trainer leaves dropout as the model has it
        cast_lm_head_to_fp32=False,
        seed=spec.seed,
        shuffle_dataset=False,
        use_cpu=True,
        bf16=False,
        fp16=False,
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", help="a ReFlow job spec (YAML)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                        help="torch threads (default: every core)")
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    args = parser.parse_intermixed_args(argv)
    process_start = time.monotonic()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from reflow.core.config import load_job_spec
    from reflow.models.tiny import ensure_model
    from reflow.tasks import ChatTask, Prompt

    spec = load_job_spec(args.config, args.overrides)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    model_dir = ensure_model(spec.model.path, spec.model.build_if_missing, seed=spec.seed)

    batch = spec.trainer.batch_size
    loss = loss_options(spec)  # before the model loads: a refused setting fails at once
    task, prompts, dataset = task_dataset(spec)
    chat = isinstance(task, ChatTask)

    step_tokens: list[int] = []

    def task_reward(prompts, completions, completion_ids, prompt_id, answer, text, **_):
        # Called once per generated batch: also where its response tokens are counted.
        step_tokens.append(sum(len(ids) for ids in completion_ids))
        # A conversation's completion is a list of messages: the assistant's text.
        texts = [c[-1]["content"] if chat else c for c in completions]
        return [task.reward(Prompt(prompt_id=pid, text=t, answer=ans), completion)
                for t, completion, pid, ans in zip(text, texts, prompt_id, answer)]

    config = grpo_config(spec, out, loss)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)  # nosec B615
    model = AutoModelForCausalLM.from_pretrained(  # nosec B615 # local dir only
        model_dir, dtype=torch.float32, local_files_only=True)

    generate_s: list[float] = []

    class TimedGRPOTrainer(GRPOTrainer):
        # Generation time, to report it as ReFlow reports a sync step's batch wait.
        def _generate(self, *a, **kw):
            t0 = time.monotonic()
            try:
                return super()._generate(*a, **kw)
            finally:
                generate_s.append(time.monotonic() - t0)

    records: list[dict] = []
    metrics_file = open(out / "metrics.jsonl", "w")  # noqa: SIM115 - closed below

    class StepRecorder(TrainerCallback):
        """The Trainer calls on_step_end after the optimizer step, then on_log with that
        step's metrics (logging_steps = 1): time at the first, record at the second."""

        def __init__(self) -> None:
            self.start = self.previous = self.step_end = 0.0

        def on_train_begin(self, *_, **__):
            self.start = self.previous = time.monotonic()

        def on_step_end(self, *_, **__):
            self.step_end = time.monotonic()

        def on_log(self, _args, state, _control, logs=None, **__):
            if not logs or "reward" not in logs:
                return  # the end-of-training summary log
            record = {
                "step": state.global_step,
                "policy_version": state.global_step,
                "reward_mean": float(logs["reward"]),
                "trained_tokens": step_tokens[-1],
                # TRL trains each batch once: every token is a first use.
                "first_use_tokens": step_tokens[-1],
                "step_time_s": self.step_end - self.previous,
                "wall_time_s": self.step_end - self.start,
                "batch_wait_s": generate_s[-1],
                "weight_sync_s": 0.0,
                "rollout_idle_ratio": 0.0,
                "fresh_samples": batch,
                "stale_samples": 0,
                "replay_samples": 0,
                "replay_fraction": 0.0,
                "max_staleness": 0,
                "loss": float(logs.get("loss", float("nan"))),
                "clip_fraction": float(logs.get("clip_ratio/region_mean", 0.0)),
                "response_len_mean": float(logs.get("completions/mean_length", 0.0)),
            }
            if not records:
                record["trainer_startup_s"] = startup_s  # as ReFlow's first record carries it
            self.previous = self.step_end
            records.append(record)
            metrics_file.write(json.dumps(record) + "\n")
            metrics_file.flush()

    trainer = TimedGRPOTrainer(model=model, processing_class=tokenizer, reward_funcs=[task_reward],
                               args=config, train_dataset=dataset, callbacks=[StepRecorder()])
    trainer.remove_callback(PrinterCallback)  # metrics.jsonl holds every step's numbers
    startup_s = time.monotonic() - process_start
    trainer.train()
    metrics_file.close()
    if len(records) != spec.trainer.num_steps:
        raise SystemExit(f"{out}: {len(records)} step records for {spec.trainer.num_steps} steps")

    wall = records[-1]["wall_time_s"]
    summary = {
        "engine": "trl",
        "trl_version": __import__("trl").__version__,
        "threads": args.threads,
        "loss_options": loss,
        "steps": len(records),
        "wall_time_s": wall,
        "startup_s": startup_s,
        "trained_tokens": sum(r["trained_tokens"] for r in records),
        "trainer_tokens_per_s_mean": sum(r["trained_tokens"] for r in records) / wall,
        "first_use_tokens_per_s_mean": sum(r["first_use_tokens"] for r in records) / wall,
        "reward_first_mean": sum(r["reward_mean"] for r in records[:10]) / min(10, len(records)),
        "reward_last_mean": sum(r["reward_mean"] for r in records[-10:]) / min(10, len(records)),
        "generation_share": sum(r["batch_wait_s"] for r in records) / wall,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
