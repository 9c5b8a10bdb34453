"""The committed evidence behind every learning table: one compact JSON file per run,
and the study file that fixed the comparison before its first run.

A study is a directory `bench/data/<study>/`:

    study.yaml            the pre-registration: job spec and overrides, entries, seeds,
                          steps, the primary metric, its window and test, the decision
                          rule; written and committed before the first run
    <entry>/seed<k>.json  one run: its command, the commit it ran at, the machine's load
                          around it, and its step records, the columns a table reads

A run's file holds its step records column by column (`columns: {field: [value per
step]}`, null where a step did not record the field), numbers rounded to six
significant digits: a 60-step run is a few tens of kilobytes, so every run of every
table can live in git. `bench/convergence_report.py` rebuilds the tables from these
files alone.

What it deliberately doesn't know: statistics, tables or how a run is started.
"""

from __future__ import annotations

import json
import math
import os
import platform
import subprocess  # nosec B404 # git rev-parse / status, fixed argv lists
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
DATA = REPO / "bench" / "data"
SCHEMA = 1

# The step-record fields a learning table may read. Everything else a record holds
# (engine internals, ledgers, the Unix time) stays in the run directory.
STEP_FIELDS = (
    "step", "policy_version", "wall_time_s", "step_time_s", "reward_mean",
    "first_use_reward_mean", "fresh_samples", "stale_samples", "replay_samples",
    "replay_fraction", "trained_tokens", "first_use_tokens", "response_len_mean",
    "trainer_idle_ratio", "rollout_idle_ratio", "batch_wait_s", "train_s", "weight_sync_s",
    "max_staleness", "evicted_samples_total", "evicted_unused_samples_total",
    "dispatched_samples_total", "clip_fraction", "mismatch_kl", "importance_ess", "entropy",
    "masked_fraction", "fresh_clip_fraction", "fresh_mismatch_kl", "fresh_importance_ess",
    "stale_clip_fraction", "stale_mismatch_kl", "stale_importance_ess",
    "replayed_clip_fraction", "replayed_mismatch_kl", "replayed_importance_ess",
    "eval_reward", "eval_policy_version", "eval_pass_at_1",
)


def _round(value: Any) -> Any:
    if isinstance(value, bool) or not isinstance(value, float):
        return value
    if not math.isfinite(value):
        return None
    return float(f"{value:.6g}")


def compact_records(records: list[dict]) -> dict[str, list]:
    """Step records as columns of the fields tables read (STEP_FIELDS), in order."""
    present = [f for f in STEP_FIELDS if any(f in r for r in records)]
    return {f: [_round(r.get(f)) for r in records] for f in present}


def expand_columns(columns: dict[str, list]) -> list[dict]:
    """The step records back from their columns (a null is a field the step lacked)."""
    lengths = {len(v) for v in columns.values()}
    if len(lengths) > 1:
        raise ValueError(f"columns of different lengths: {sorted(lengths)}")
    num = lengths.pop() if lengths else 0
    return [{f: v[i] for f, v in columns.items() if v[i] is not None} for i in range(num)]


def git_commit() -> dict[str, Any]:
    """The commit the benchmark runs at, and whether the tree had uncommitted changes."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True,  # nosec B603 B607
                              text=True, check=False).stdout.strip()
    return {"commit": git("rev-parse", "HEAD"),
            "dirty": bool(git("status", "--porcelain", "--untracked-files=no"))}


def machine() -> dict[str, Any]:
    """What the run shared the machine with: cores and the load average now."""
    return {"cpus": os.cpu_count(), "platform": platform.platform(),
            "python": platform.python_version(), "load_avg": list(os.getloadavg())}


def run_path(data_dir: Path, entry: str, seed: int) -> Path:
    return data_dir / entry / f"seed{seed}.json"


def write_run(data_dir: Path, entry: str, seed: int, *, command: list[str],
              records: list[dict], elapsed_s: float, returncode: int,
              machine_before: dict, machine_after: dict, extra: dict | None = None) -> Path:
    """One finished run's committed file; the command is stored relative to the
    repository where it points into it, so the file reads the same on any checkout."""
    root = str(REPO) + os.sep
    path = run_path(data_dir, entry, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = {"schema": SCHEMA, "entry": entry, "seed": seed,
            "command": [c.replace(root, "") for c in command], **git_commit(),
            "machine_before": machine_before, "machine_after": machine_after,
            "elapsed_s": _round(elapsed_s), "returncode": returncode,
            **(extra or {}), "num_steps": len(records), "columns": compact_records(records)}
    path.write_text(json.dumps(body, separators=(",", ":")) + "\n")
    return path


def read_run(path: Path) -> dict[str, Any]:
    """A committed run: its metadata and `records` (the step records, expanded)."""
    body = json.loads(path.read_text())
    if body.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {body.get('schema')!r}, this reader knows {SCHEMA}")
    body["records"] = expand_columns(body.pop("columns"))
    return body
