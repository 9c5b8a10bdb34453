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
    trainer.learning_rate           learning_rate (lr_scheduler_type "constant", no warm-up)
    trainer.weight_decay            weight_decay
    trainer.max_grad_norm           max_grad_norm
    trainer.clip_eps                epsilon
    rollout.max_tokens              max_completion_length
    rollout.temperature             temperature (top_p 1, top_k off)
    (no KL term)                    beta = 0
    token-level loss                loss_type "dapo" (sum over tokens / tokens in the batch)
    group-normalised advantage      scale_rewards "group"
    seed                            seed; prompts in the task's seeded order (no shuffle)

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
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOConfig, GRPOTrainer

    from reflow.core.config import load_job_spec
    from reflow.models.tiny import ensure_model
    from reflow.tasks import ChatTask, Prompt, build_task

    spec = load_job_spec(args.config, args.overrides)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    model_dir = ensure_model(spec.model.path, spec.model.build_if_missing, seed=spec.seed)

    batch, group = spec.trainer.batch_size, spec.rollout.group_size
    task = build_task(spec)  # the same prompt stream the job's dispatcher draws
    stream = task.prompts()
    prompts = [next(stream) for _ in range(spec.trainer.num_steps * batch // group)]
    # A chat task's prompts go to TRL as conversations: TRL renders them with the
    # model's chat template, as ReFlow's rollout workers do.
    chat = isinstance(task, ChatTask)
    dataset = Dataset.from_list([{"prompt": task.prompt_messages(p) if chat else p.text,
                                  "prompt_id": p.prompt_id, "answer": p.answer, "text": p.text}
                                 for p in prompts])

    step_tokens: list[int] = []

    def task_reward(prompts, completions, completion_ids, prompt_id, answer, text, **_):
        # Called once per generated batch: also where its response tokens are counted.
        step_tokens.append(sum(len(ids) for ids in completion_ids))
        # A conversation's completion is a list of messages: the assistant's text.
        texts = [c[-1]["content"] if chat else c for c in completions]
        return [task.reward(Prompt(prompt_id=pid, text=t, answer=ans), completion)
                for t, completion, pid, ans in zip(text, texts, prompt_id, answer)]

    config = GRPOConfig(
        output_dir=str(out / "trl"),
        num_generations=group,
        per_device_train_batch_size=batch,
        gradient_accumulation_steps=1,
        steps_per_generation=1,
        num_iterations=1,
        max_steps=spec.trainer.num_steps,
        learning_rate=spec.trainer.learning_rate,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=spec.trainer.weight_decay,
        max_grad_norm=spec.trainer.max_grad_norm,
        epsilon=spec.trainer.clip_eps,
        beta=0.0,
        loss_type="dapo",
        scale_rewards="group",
        max_completion_length=spec.rollout.max_tokens,
        temperature=spec.rollout.temperature,
        top_p=1.0,
        top_k=0,
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
        "steps": len(records),
        "wall_time_s": wall,
        "startup_s": startup_s,
        "trained_tokens": sum(r["trained_tokens"] for r in records),
        "trainer_tokens_per_s_mean": sum(r["trained_tokens"] for r in records) / wall,
        "reward_first_mean": sum(r["reward_mean"] for r in records[:10]) / min(10, len(records)),
        "reward_last_mean": sum(r["reward_mean"] for r in records[-10:]) / min(10, len(records)),
        "generation_share": sum(r["batch_wait_s"] for r in records) / wall,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
