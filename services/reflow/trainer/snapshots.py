"""Policy snapshots (`trainer.policy_snapshot_interval`): the policy itself, in the
format of a run's final policy (Hugging Face, LoRA merged), every N steps under
`<run_dir>/policies/step-<N>`, for scoring later with `reflow eval`.

Checkpoints are for resuming (model, optimizer, RNG, sharded, the newest few kept);
snapshots are for comparing runs by what their policies can do at a point chosen
after the fact: a wall time, a count of first-use samples. Evaluating them after
the run keeps the evaluation off the run's engines, so it costs the run nothing
and weighs the same in every mode.

A snapshot is written to `step-<N>.partial` and renamed when whole, so a reader
sees a whole snapshot or none; `reflow-policy.json` in it names its step, policy
version and job.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from pathlib import Path

SNAPSHOT_DIR = "policies"
SNAPSHOT_META = "reflow-policy.json"


def snapshot_due(interval: int, step: int, num_steps: int) -> bool:
    """Every `interval` steps, not at the last one (the run's final policy is that)."""
    return interval > 0 and step % interval == 0 and step < num_steps


def write_snapshot(save: Callable[[Path], None], run_dir: Path, step: int,
                   policy_version: int, job_id: str) -> float:
    """Write this step's policy with `save` (the trainer's final export); returns the
    seconds it took, which the step record carries as `policy_snapshot_s`."""
    started = time.monotonic()
    path = Path(run_dir) / SNAPSHOT_DIR / f"step-{step}"
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    save(partial)
    (partial / SNAPSHOT_META).write_text(json.dumps(
        {"step": step, "policy_version": policy_version, "job_id": job_id}) + "\n")
    if path.exists():  # a resumed trainer writes the step again
        shutil.rmtree(path)
    os.replace(partial, path)
    return time.monotonic() - started


def snapshot_fields(loop) -> dict[str, float]:
    """Write the loop's policy if a snapshot is due after its step; the record's field.
    A sharded trainer's whole weights are gathered at the end only (config refuses
    snapshots with fsdp/hsdp; `auto` resolving to fsdp writes none)."""
    if loop.run_dir is None or loop.root is not None or not snapshot_due(
            loop.spec.trainer.policy_snapshot_interval, loop.step, loop.spec.trainer.num_steps):
        return {}
    return {"policy_snapshot_s": write_snapshot(loop.save, loop.run_dir, loop.step,
                                                loop.policy_version, loop.job_id)}
