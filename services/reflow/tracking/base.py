"""What a tracker is: one small interface every backend implements, the context it
is built with, and the pure helpers that turn the trainer's records into what the
backends log (scalars, flattened parameters, a generations table).

A tracker is called from one background thread only (`reflow.tracking.hub`), so
it needs no locking; it may block or raise, and the hub copes with both. This
module knows no tracker package.
"""

from __future__ import annotations

import json
import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from reflow.core.tracking_config import TrackingConfig

# Columns of a generations table, in order.
GENERATION_COLUMNS = ("step", "policy_version", "reward", "prompt", "response")
# An MLflow parameter value holds at most this many characters (and is cut to it).
MAX_PARAM_CHARS = 500


@dataclass(frozen=True)
class TrackerContext:
    """What a tracker is built with: where the run's files go, which job it is,
    and the spec's tracking section."""

    run_dir: Path
    job_id: str
    job_name: str
    settings: TrackingConfig


class Tracker(ABC):
    """One experiment tracker. The hub calls `start` once before anything else,
    then the log methods in the order the trainer produced the data, then `close`.
    Steps are the trainer's step numbers (`step` of metrics.jsonl)."""

    name = "tracker"

    def __init__(self, context: TrackerContext) -> None:
        self.context = context

    @abstractmethod
    def start(self, config: dict[str, Any]) -> None:
        """Open the run and log the job's resolved configuration (nested dict)."""

    @abstractmethod
    def log_step(self, step: int, scalars: dict[str, float]) -> None:
        """A step record's numeric fields (evaluation fields excluded)."""

    @abstractmethod
    def log_eval(self, step: int, policy_version: int, scalars: dict[str, float]) -> None:
        """An evaluation's numeric `eval_*` fields: it scored `policy_version`, and
        its result arrived with the record of `step`."""

    @abstractmethod
    def log_generations(self, step: int, rows: list[dict[str, Any]]) -> None:
        """A table of sampled generations, each row keyed by GENERATION_COLUMNS."""

    @abstractmethod
    def close(self) -> None:
        """Flush and close the run (the job ended)."""


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)) and math.isfinite(value):
        return float(value)
    return None  # strings, nested histograms, NaN and infinities are not curves


def split_record(record: dict[str, Any]) -> tuple[int, dict[str, float], int | None,
                                                  dict[str, float]]:
    """A metrics.jsonl record as (step, training scalars, evaluated policy version,
    evaluation scalars). The evaluation's are its numeric `eval_*` fields; the
    version is None when the record carries no evaluation."""
    step = int(record["step"])
    train: dict[str, float] = {}
    evals: dict[str, float] = {}
    for key, value in record.items():
        number = _number(value)
        if key == "step" or number is None:
            continue
        (evals if key.startswith("eval_") else train)[key] = number
    version = evals.pop("eval_policy_version", None)
    if not evals:
        return step, train, None, {}
    return step, train, int(version) if version is not None else step, evals


def flatten_config(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """`{"trainer": {"batch_size": 64}}` as `{"trainer.batch_size": "64"}`: MLflow
    parameters are flat strings. Lists and mappings below a section are JSON."""
    flat: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and not prefix:
            flat.update(flatten_config(value, f"{name}."))
            continue
        text = value if isinstance(value, str) else json.dumps(value, sort_keys=True)
        flat[name] = text[:MAX_PARAM_CHARS]
    return flat


def truncate(text: str, max_chars: int) -> str:
    if len(text) <= max_chars:
        return text
    return text[: max_chars - 1] + "…"


def markdown_table(rows: list[dict[str, Any]]) -> str:
    """Rows as a Markdown table (TensorBoard's text plugin renders Markdown)."""
    def cell(value: Any) -> str:
        text = f"{value:.4g}" if isinstance(value, float) else str(value)
        return text.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "⏎")

    lines = ["| " + " | ".join(GENERATION_COLUMNS) + " |",
             "|" + "---|" * len(GENERATION_COLUMNS)]
    lines += ["| " + " | ".join(cell(row[c]) for c in GENERATION_COLUMNS) + " |" for row in rows]
    return "\n".join(lines)
