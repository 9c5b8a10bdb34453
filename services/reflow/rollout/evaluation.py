"""Periodic evaluation on a task's held-out split, on a rollout worker's engine
beside its training samples (`eval.interval`): one sample per held-out prompt
(greedy, or at the job's temperature), scored like any other, nothing put to
the buffer and nothing counted in the dispatcher's concurrency slots, so
training neither waits for it nor changes because of it.

A weight update that lands mid-evaluation pauses its samples like any others
(partial rollout); the result is labelled with the version loaded when it
started, which is the version its first tokens came from.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, replace

from reflow.rollout.engine import SamplingSpec
from reflow.rollout.records import PartialSample
from reflow.rollout.scoring import score_texts

MAX_EVAL_PROMPTS = 4096


@dataclass(frozen=True)
class EvalResult:
    reward_mean: float
    num_samples: int
    num_errors: int
    policy_version: int
    seconds: float


async def _generate_one(engine, request_id: str, prompt_ids: list[int],
                        sampling: SamplingSpec) -> PartialSample:
    sample = PartialSample()
    async for delta in engine.generate(request_id, prompt_ids, sampling):
        sample.response_ids += delta.token_ids
    return sample


async def run_evaluation(worker, num_prompts: int, greedy: bool) -> EvalResult:
    """Score the first `num_prompts` held-out prompts of `worker`'s task."""
    started = time.monotonic()
    await worker._resumed.wait()  # an update in progress: evaluate the new weights
    version = worker.counters.policy_version
    prompts = worker.task.eval_prompts(num_prompts)
    if not prompts:
        raise ValueError("num_prompts: the task's held-out split is empty")
    rollout = worker.spec.rollout
    # Greedy, or the training samples' law (temperature and truncation).
    sampling = (SamplingSpec(max_tokens=rollout.max_tokens, temperature=0.0) if greedy else
                SamplingSpec(max_tokens=rollout.max_tokens, temperature=rollout.temperature,
                             top_p=rollout.top_p, top_k=rollout.top_k))
    tag = f"eval-v{version}-{time.monotonic_ns()}"
    if worker.episodes is not None:
        episodes = await asyncio.gather(*(
            worker.episodes.play(worker.engine.generate, f"{tag}-{i}", p, sampling,
                                 lambda: worker.counters.policy_version)
            for i, p in enumerate(prompts)))
        outcomes = [(e.reward, e.reward_error) for e in episodes]
    else:
        samples = await asyncio.gather(*(
            _generate_one(worker.engine, f"{tag}-{i}", worker.encode(p),
                          replace(sampling, seed=i))
            for i, p in enumerate(prompts)))
        texts = [worker.decode(s.response_ids) for s in samples]
        results = []
        for prompt, text in zip(prompts, texts):
            results += await score_texts(worker.score, prompt, [text])
        outcomes = [(r.value, r.error) for r in results]
    scored = [value for value, error in outcomes if not error]
    return EvalResult(reward_mean=sum(scored) / len(scored) if scored else 0.0,
                      num_samples=len(scored), num_errors=len(outcomes) - len(scored),
                      policy_version=version, seconds=time.monotonic() - started)
