"""Same batches, two trainers: ReFlow's optimiser step against TRL's GRPOTrainer,
step for step, from the same weights.

    make bench-trl-env
    bench/.venv-trl/bin/python bench/trl_step_parity.py examples/math.yaml --out DIR \
        [section.field=value ...]

TRL runs as `bench/trl_grpo.py` runs it (the same GRPOConfig, every loss option
pinned from the spec) and generates its own batches with Hugging Face `generate`.
Each generated batch (its prompt and completion tokens, and the rewards TRL's reward
call returned) is also handed, before TRL's step, to ReFlow's `compute_step` on a
second copy of the model, as a sync-mode batch: the behaviour log-probs are the
ReFlow copy's own, scored just before its step, and the advantages come from the
spec's `algorithm.advantage` estimator, as a rollout worker computes them. Both
copies then take one AdamW step on the same samples.

What it separates: if the two copies stay together, ReFlow's update rule (prompt
tokens, reward, advantages, loss, aggregation, clipping, optimizer) is TRL's, and a
difference between the two systems' learning curves lies in the samples each draws,
not in what either does with them. Per step it writes the two losses and gradient
norms, the parameter distance between the copies against the distance each moved
from the initial weights, and whether the prompt tokens ReFlow's chat task renders
equal the ones TRL fed `generate`.

Writes DIR/parity.jsonl (one record per step) and DIR/summary.json.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services"))
sys.path.insert(0, str(REPO / "bench"))


def _flat(model) -> "torch.Tensor":  # noqa: F821 - torch imported in main
    import torch

    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("config", help="a ReFlow job spec (YAML)")
    parser.add_argument("--out", required=True, help="output directory")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("overrides", nargs="*", metavar="section.field=value")
    args = parser.parse_intermixed_args(argv)

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.trainer_callback import PrinterCallback
    from trl import GRPOTrainer

    from reflow.algorithms.advantages import load_estimator
    from reflow.core.config import load_job_spec
    from reflow.core.types import Segment, Trajectory
    from reflow.models.tiny import ensure_model
    from reflow.tasks import ChatTask, Prompt
    from reflow.tasks.chat import ChatRenderer
    from reflow.trainer.schedule import set_learning_rate
    from reflow.trainer.step import collate, compute_step, sequence_logprobs
    from trl_grpo import grpo_config, loss_options, task_dataset

    spec = load_job_spec(args.config, args.overrides)
    out = Path(args.out).absolute()
    out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    torch.manual_seed(spec.seed)
    model_dir = ensure_model(spec.model.path, spec.model.build_if_missing, seed=spec.seed)
    group = spec.rollout.group_size
    loss = loss_options(spec)
    task, prompts, dataset = task_dataset(spec)
    chat = isinstance(task, ChatTask)
    by_id = {p.prompt_id: p for p in prompts}

    rewards_seen: list[list[float]] = []

    def task_reward(prompts, completions, completion_ids, prompt_id, answer, text, **_):
        texts = [c[-1]["content"] if chat else c for c in completions]
        values = [task.reward(Prompt(prompt_id=pid, text=t, answer=ans), completion)
                  for t, completion, pid, ans in zip(text, texts, prompt_id, answer)]
        rewards_seen.append(list(values))
        return values

    config = grpo_config(spec, out, loss)
    tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)  # nosec B615
    trl_model = AutoModelForCausalLM.from_pretrained(  # nosec B615 # local dir only
        model_dir, dtype=torch.float32, local_files_only=True)
    ours = copy.deepcopy(trl_model).train()
    optimizer = torch.optim.AdamW(ours.parameters(), lr=spec.trainer.learning_rate,
                                  weight_decay=spec.trainer.weight_decay)
    estimator = load_estimator(spec.algorithm.advantage_name)
    pad_id = tokenizer.pad_token_id or 0
    start = _flat(trl_model).clone()
    # How a rollout worker renders a chat task's prompt (rollout.service.prompt_encoder).
    renderer = ChatRenderer(tokenizer)
    eos_ids = renderer.stop_token_ids
    records: list[dict] = []
    parity_file = open(out / "parity.jsonl", "w")  # noqa: SIM115 - closed below

    class ParityTrainer(GRPOTrainer):
        def _generate_and_score_completions(self, inputs):
            output = super()._generate_and_score_completions(inputs)
            self._reflow_step(inputs, output)
            return output

        def _reflow_step(self, inputs, output):
            prompt_mask, completion_mask = output["prompt_mask"], output["completion_mask"]
            rewards = rewards_seen[-1]
            trajectories, rendered_equal = [], 0
            for i, row in enumerate(inputs):
                p_ids = output["prompt_ids"][i][prompt_mask[i].bool()].tolist()
                c_ids = output["completion_ids"][i][completion_mask[i].bool()].tolist()
                prompt = by_id[row["prompt_id"]]
                rendered = renderer.prompt_ids(task.prompt_messages(prompt)) if chat else \
                    tokenizer.encode(prompt.text, add_special_tokens=False)
                rendered_equal += int(list(rendered) == p_ids)
                trajectories.append(Trajectory(
                    sample_id=f"s{len(records)}-{i}", group_id=f"g{len(records)}-{i // group}",
                    prompt_ids=p_ids, response_ids=c_ids, logprobs=[0.0] * len(c_ids),
                    loss_mask=[1] * len(c_ids), segments=[Segment(len(records), len(c_ids))],
                    reward=float(rewards[i]),
                    finish_reason="stop" if c_ids and c_ids[-1] in eos_ids else "length"))
            for g in range(0, len(trajectories), group):
                members = trajectories[g:g + group]
                for t, a in zip(members, estimator.compute([t.reward for t in members])):
                    t.advantage = float(a)
            # Behaviour log-probs: the ReFlow copy's own, as a sync batch's engine has them.
            with torch.no_grad():
                tb = collate(trajectories, pad_id, torch.device("cpu"))
                lp = sequence_logprobs(ours, tb.input_ids, tb.attention_mask,
                                       spec.rollout.temperature, spec.trainer.logprob_chunk_tokens)
            for i, t in enumerate(trajectories):
                p = len(t.prompt_ids)
                t.logprobs = lp[i, p - 1:p - 1 + len(t.response_ids)].tolist()
            step = len(records) + 1
            set_learning_rate(optimizer, spec.trainer, step)
            (stats, grad_norm), _ = compute_step(ours, optimizer, spec, trajectories, pad_id,
                                                 torch.device("cpu"), step=step)
            trl_adv = output["advantages"].tolist()
            records.append({"step": step, "reflow_loss": stats.loss,
                            "reflow_grad_norm": grad_norm,
                            "prompts_rendered_equal": rendered_equal / len(trajectories),
                            "reward_mean": sum(rewards) / len(rewards),
                            "advantage_max_abs_diff": max(abs(t.advantage - a) for t, a in
                                                          zip(trajectories, trl_adv)),
                            "response_len_mean": sum(len(t.response_ids) for t in trajectories)
                            / len(trajectories)})

        def training_step(self, model, inputs, num_items_in_batch):
            loss_value = super().training_step(model, inputs, num_items_in_batch)
            records[-1]["trl_loss"] = float(loss_value)
            return loss_value

    from transformers import TrainerCallback

    class StepEnd(TrainerCallback):
        def on_step_end(self, *_, **__):
            a, b = _flat(trl_model), _flat(ours)
            moved_trl = float((a - start).norm())
            moved_ours = float((b - start).norm())
            apart = float((a - b).norm())
            records[-1].update({"moved_trl": moved_trl, "moved_reflow": moved_ours,
                                "apart": apart,
                                "apart_rel": apart / moved_trl if moved_trl else math.nan})

        def on_log(self, _args, state, _control, logs=None, **__):
            if logs and "grad_norm" in logs and records:
                records[-1]["trl_grad_norm"] = float(logs["grad_norm"])
                parity_file.write(json.dumps(records[-1]) + "\n")
                parity_file.flush()

    trainer = ParityTrainer(model=trl_model, processing_class=tokenizer,
                            reward_funcs=[task_reward], args=config, train_dataset=dataset,
                            callbacks=[StepEnd()])
    trainer.remove_callback(PrinterCallback)
    trainer.train()
    parity_file.close()
    summary = {
        "trl_version": __import__("trl").__version__,
        "advantage": spec.algorithm.advantage_name,
        "loss_options": loss,
        "steps": len(records),
        "prompts_rendered_equal": min(r["prompts_rendered_equal"] for r in records),
        "final_apart_rel": records[-1].get("apart_rel"),
        "max_apart_rel": max(r.get("apart_rel", 0.0) for r in records),
        "records": records,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(f"{'step':>4} {'reward':>7} {'len':>5} {'loss R':>9} {'loss T':>9} "
          f"{'gnorm R':>8} {'gnorm T':>8} {'|adv Δ|':>8} {'moved':>8} {'apart/moved':>11}")
    for r in records:
        print(f"{r['step']:>4} {r['reward_mean']:>7.3f} {r['response_len_mean']:>5.1f} "
              f"{r['reflow_loss']:>9.5f} {r.get('trl_loss', math.nan):>9.5f} "
              f"{r['reflow_grad_norm']:>8.4f} {r.get('trl_grad_norm', math.nan):>8.4f} "
              f"{r['advantage_max_abs_diff']:>8.5f} {r.get('moved_trl', math.nan):>8.5f} "
              f"{r.get('apart_rel', math.nan):>11.2e}")
    print(json.dumps({k: v for k, v in summary.items() if k != "records"}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
