"""A saved policy scored on its task's held-out split, outside any job (`reflow
eval`): the product's evaluation (rollout/evaluation.py) on an engine of its own,
rewards scored in confined processes as a rollout worker scores them.

What it is for: comparing runs by what their policies can do, at points chosen
after the fact (a wall time, a count of first-use samples), from the snapshots a
trainer writes (`trainer.policy_snapshot_interval`) and its final `policy/`. The
evaluation of a run then never shares the engine with the run's own generation,
so it costs the run nothing and is the same for every mode.

What it deliberately doesn't know: runs, snapshots or which policy a comparison
picks. It takes a job spec (its task, rollout and eval sections) and directories.
The directories come from the operator's own command line, not from a job spec.
"""

from __future__ import annotations

import asyncio
import gc
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from reflow.core.config import JobSpec
from reflow.rollout.evaluation import EvalPlan, EvalResult, result_fields, run_evaluation
from reflow.rollout.multiturn import EpisodeRunner

logger = logging.getLogger(__name__)


@dataclass
class _Counters:
    policy_version: int = 0


@dataclass
class _EvalHost:
    """What run_evaluation reads of a rollout worker: its spec, task, engine,
    prompt encoding, response decoding, scorer or episode runner, the version it
    holds, and whether a weight update is in progress (never, here)."""

    spec: JobSpec
    task: Any
    engine: Any
    encode: Any
    decode: Any
    score: Any
    episodes: EpisodeRunner | None
    counters: _Counters = field(default_factory=_Counters)
    _resumed: asyncio.Event | None = None


def eval_plan(spec: JobSpec, num_prompts: int | None = None) -> EvalPlan:
    """The job's evaluation settings (greedy unless `eval.sampled`), for `num_prompts`
    held-out prompts (None: `eval.num_prompts`)."""
    c = spec.eval
    return EvalPlan(num_prompts=num_prompts or c.num_prompts, greedy=not c.sampled, k=c.k,
                    temperature=c.temperature or 0.0, correct_threshold=c.correct_threshold)


def _vllm_engine(spec: JobSpec, policy_dir: Path):
    from reflow.rollout.vllm_engine import VllmEngine

    # The merged policy alone: no adapter slot, whatever the job trained with.
    return VllmEngine(str(policy_dir), dtype=spec.model.dtype, kv_cache_gb=spec.rollout.kv_cache_gb,
                      seed=spec.seed, tensor_parallel_size=spec.rollout.tensor_parallel_size)


def evaluate_policy(spec: JobSpec, policy_dir: Path, datasets_root: Path,
                    num_prompts: int | None = None,
                    engine_factory: Callable[[JobSpec, Path], Any] = _vllm_engine
                    ) -> dict[str, Any]:
    """Score the policy in `policy_dir` (a Hugging Face directory: a run's `policy/`
    or a snapshot, LoRA already merged) on the first `num_prompts` held-out prompts
    of `spec`'s task, on the engine `engine_factory(spec, policy_dir)` builds (vLLM's).
    Returns the metrics a step record's `eval_*` fields carry."""
    from transformers import AutoTokenizer

    from reflow.rollout.service import prompt_encoder
    from reflow.tasks import build_task, is_multi_turn, task_context
    from reflow.tasks.rewards import RewardPool

    policy_dir = Path(policy_dir)
    if not (policy_dir / "config.json").is_file():
        raise ValueError(f"--policy {policy_dir}: not a model directory (no config.json); give "
                         "a run's policy/ or a snapshot under its policies/")
    plan = eval_plan(spec, num_prompts)
    task = build_task(spec, datasets_root, "eval")
    tokenizer = AutoTokenizer.from_pretrained(str(policy_dir),  # nosec B615 # local dir only
                                              local_files_only=True)
    encode, renderer = prompt_encoder(task, tokenizer)
    rewards = None
    episodes = None
    if is_multi_turn(task):
        episodes = EpisodeRunner(task, renderer)
    else:
        rewards = RewardPool(spec.task.name, spec.task.args, task_context(spec, datasets_root),
                             spec.task.reward_workers, spec.task.reward_timeout_s,
                             limits=spec.task.reward_limits)
    engine = engine_factory(spec, policy_dir)
    try:
        host = _EvalHost(spec, task, engine, encode,
                         lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
                         rewards.score if rewards is not None else None, episodes,
                         _Counters(_snapshot_version(policy_dir)))
        result = asyncio.run(_evaluate(host, plan))
    finally:
        engine.shutdown()
        if rewards is not None:
            rewards.close()
        # vLLM's engine shuts down again when collected: here, not at interpreter exit
        # when the modules it calls are gone.
        host = engine = None
        gc.collect()
    return {**result_fields(result, spec.eval.pass_k),
            "eval_num_prompts": len(result.prompts)}


def _snapshot_version(policy_dir: Path) -> int:
    """The policy version a snapshot names (trainer/snapshots.py); 0 for any other
    directory (the initial weights, a run's final policy)."""
    try:
        return int(json.loads((policy_dir / "reflow-policy.json").read_text())["policy_version"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0


async def _evaluate(host: _EvalHost, plan: EvalPlan) -> EvalResult:
    host._resumed = asyncio.Event()
    host._resumed.set()
    started = time.monotonic()
    result = await run_evaluation(host, plan)
    logger.info("evaluated %d held-out samples in %.1f s", result.num_samples,
                time.monotonic() - started)
    return result
