"""Periodic evaluation on a task's held-out split, on a rollout worker's engine
beside its training samples (`eval.interval`): k samples per held-out prompt
(one greedy, or k sampled with distinct seeds), scored like any other, nothing
put to the buffer and nothing counted in the dispatcher's concurrency slots, so
training neither waits for it nor changes because of it.

Each prompt's samples are counted here (scored, correct, reward sum, errors,
whether the majority-voted answer is correct); the metrics over prompts
(pass@k, avg@k, maj@k) are reflow.rollout.eval_metrics'. Votes need the task's
`final_answer` (reflow.tasks.base.AnswerTask); a task without it, and every
multi-turn task, casts none, and maj@k is not reported for it.

A weight update that lands mid-evaluation pauses its samples like any others
(partial rollout); the result is labelled with the version loaded when it
started, which is the version its first tokens came from.
"""

from __future__ import annotations

import asyncio
import math
import time
from dataclasses import dataclass, replace

from reflow.core.task_config import MAX_EVAL_K
from reflow.rollout.engine import SamplingSpec
from reflow.rollout.eval_metrics import PromptOutcome, majority_index, summarize
from reflow.rollout.records import PartialSample
from reflow.rollout.scoring import score_texts
from reflow.tasks.base import AnswerTask, Prompt

MAX_EVAL_PROMPTS = 4096


@dataclass(frozen=True)
class EvalPlan:
    """What one evaluation generates (eval.num_prompts, eval.k, ...)."""

    num_prompts: int
    greedy: bool = True
    k: int = 1
    # Of a sampled evaluation; 0: the job's rollout.temperature.
    temperature: float = 0.0
    correct_threshold: float = 1.0

    def __post_init__(self) -> None:
        if not 1 <= self.num_prompts <= MAX_EVAL_PROMPTS:
            raise ValueError(f"num_prompts: {self.num_prompts}; need 1 to {MAX_EVAL_PROMPTS}")
        if not 1 <= self.k <= MAX_EVAL_K:
            raise ValueError(f"k: {self.k}; need 1 to {MAX_EVAL_K}")
        if self.greedy and self.k > 1:
            raise ValueError("greedy: k > 1 needs sampling")
        if not 0.0 <= self.temperature <= 4.0:
            raise ValueError(f"temperature: {self.temperature}; need 0 (the job's) to 4")
        if not math.isfinite(self.correct_threshold):
            raise ValueError(f"correct_threshold: {self.correct_threshold}; need a finite number")


@dataclass(frozen=True)
class EvalResult:
    reward_mean: float
    num_samples: int
    num_errors: int
    policy_version: int
    seconds: float
    k: int = 1
    # Each held-out prompt's samples, counted, in held-out order.
    prompts: tuple[PromptOutcome, ...] = ()
    # The task gives final answers: `majority_correct` is a vote (maj@k).
    voted: bool = False


async def _generate_one(engine, request_id: str, prompt_ids: list[int],
                        sampling: SamplingSpec) -> PartialSample:
    sample = PartialSample()
    async for delta in engine.generate(request_id, prompt_ids, sampling):
        sample.response_ids += delta.token_ids
    return sample


def _sampling(worker, plan: EvalPlan) -> SamplingSpec:
    rollout = worker.spec.rollout
    if plan.greedy:
        return SamplingSpec(max_tokens=rollout.max_tokens, temperature=0.0)
    # The training samples' law (truncation included), at the evaluation's temperature.
    return SamplingSpec(max_tokens=rollout.max_tokens,
                        temperature=plan.temperature or rollout.temperature,
                        top_p=rollout.top_p, top_k=rollout.top_k)


async def _single_turn(worker, tag: str, prompts: list[Prompt], sampling: SamplingSpec,
                       k: int) -> tuple[list[list[tuple[float, str]]], list[list[str]] | None]:
    """Every prompt's k (reward, error) pairs and, where the task gives them, the
    samples' final answers."""
    samples = await asyncio.gather(*(
        _generate_one(worker.engine, f"{tag}-{i}-{j}", worker.encode(p),
                      replace(sampling, seed=i * k + j))
        for i, p in enumerate(prompts) for j in range(k)))
    texts = [worker.decode(s.response_ids) for s in samples]
    by_prompt = [texts[i * k:(i + 1) * k] for i in range(len(prompts))]
    outcomes = []
    for prompt, group in zip(prompts, by_prompt):
        results = await score_texts(worker.score, prompt, group)
        outcomes.append([(r.value, r.error) for r in results])
    answers = None
    if isinstance(worker.task, AnswerTask):
        # Off the event loop: a task's extraction is its own code, on texts up to
        # max_tokens long.
        answers = await asyncio.to_thread(
            lambda: [[worker.task.final_answer(p, t) for t in group]
                     for p, group in zip(prompts, by_prompt)])
    return outcomes, answers


def _count(outcomes: list[tuple[float, str]], answers: list[str | None] | None,
           threshold: float) -> PromptOutcome:
    scored = [value for value, error in outcomes if not error]
    majority_correct = False
    if answers is not None:
        # A sample without a reward casts no vote: its correctness was never checked.
        votes = [a if not error else None for a, (_, error) in zip(answers, outcomes)]
        winner = majority_index(votes)
        majority_correct = winner is not None and outcomes[winner][0] >= threshold
    return PromptOutcome(num_scored=len(scored),
                         num_correct=sum(1 for v in scored if v >= threshold),
                         reward_sum=float(sum(scored)), num_errors=len(outcomes) - len(scored),
                         majority_correct=majority_correct)


async def run_evaluation(worker, plan: EvalPlan) -> EvalResult:
    """Score the first `plan.num_prompts` held-out prompts of `worker`'s task,
    `plan.k` samples each."""
    started = time.monotonic()
    await worker._resumed.wait()  # an update in progress: evaluate the new weights
    version = worker.counters.policy_version
    prompts = worker.task.eval_prompts(plan.num_prompts)
    if not prompts:
        raise ValueError("num_prompts: the task's held-out split is empty")
    sampling, k = _sampling(worker, plan), plan.k
    tag = f"eval-v{version}-{time.monotonic_ns()}"
    answers = None
    if worker.episodes is not None:
        episodes = await asyncio.gather(*(
            worker.episodes.play(worker.engine.generate, f"{tag}-{i}-{j}", p,
                                 replace(sampling, seed=i * k + j),
                                 lambda: worker.counters.policy_version)
            for i, p in enumerate(prompts) for j in range(k)))
        flat = [(e.reward, e.reward_error) for e in episodes]
        outcomes = [flat[i * k:(i + 1) * k] for i in range(len(prompts))]
    else:
        outcomes, answers = await _single_turn(worker, tag, prompts, sampling, k)
    counted = tuple(_count(o, answers[i] if answers is not None else None,
                           plan.correct_threshold) for i, o in enumerate(outcomes))
    num_scored = sum(c.num_scored for c in counted)
    reward_sum = sum(c.reward_sum for c in counted)
    return EvalResult(reward_mean=reward_sum / num_scored if num_scored else 0.0,
                      num_samples=num_scored, num_errors=sum(c.num_errors for c in counted),
                      policy_version=version, seconds=time.monotonic() - started, k=k,
                      prompts=counted, voted=answers is not None)


def result_fields(result: EvalResult, pass_k: list[int] | tuple[int, ...] = ()) -> dict:
    """An evaluation's fields as a step record carries them (`eval_reward`,
    `eval_policy_version`, ..., pass@1, pass@k and pass@k' for each k' of `pass_k`,
    avg@k, maj@k where voted), for the trainer's periodic evaluation and `reflow
    eval` alike."""
    fields = {"eval_reward": result.reward_mean, "eval_policy_version": result.policy_version,
              "eval_samples": result.num_samples, "eval_errors": result.num_errors,
              "eval_s": result.seconds}
    if not result.prompts:
        return fields
    k = result.k
    metrics = summarize(result.prompts, [1, k, *pass_k], result.voted)
    fields.update({"eval_k": k, "eval_pass_at_1": metrics["pass_at_1"],
                   "eval_pass_at_k": metrics[f"pass_at_{k}"], "eval_avg_at_k": metrics["avg"]})
    fields.update({f"eval_pass_at_{j}": metrics[f"pass_at_{j}"] for j in pass_k})
    if "maj" in metrics:
        fields["eval_maj_at_k"] = metrics["maj"]
    return fields
