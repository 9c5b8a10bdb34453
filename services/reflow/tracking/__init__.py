"""Experiment trackers (TensorBoard, MLflow, Weights & Biases) following a
training run beside metrics.jsonl: the `Tracker` interface (base.py), one module
per built-in backend, and the hub that feeds them from a background thread
(hub.py). The spec's `tracking` section and the registry of tracker names live in
`reflow.core.tracking_config`.

`register_tracker(name, factory)` adds a tracker in-process (a program embedding
the trainer, tests); an operator's image adds one as an entry point in group
`reflow.trackers`.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from reflow.core.config import JobSpec
from reflow.core.tracking_config import register_tracker, unregister_tracker
from reflow.tracking.base import GENERATION_COLUMNS, Tracker, TrackerContext
from reflow.tracking.hub import TrackerHub, resolve_tracker

__all__ = ["GENERATION_COLUMNS", "Tracker", "TrackerContext", "TrackerHub", "open_trackers",
           "register_tracker", "resolve_tracker", "unregister_tracker"]


def open_trackers(job_id: str, spec: JobSpec, run_dir: Path | None,
                  on_error: Callable[[str], None] | None = None,
                  on_drop: Callable[[], None] | None = None) -> TrackerHub | None:
    """The job's trackers, started in the background with the resolved spec; None
    when `tracking.backends` is empty or the process writes no run directory (a
    replica of the trainer group: only the rank that writes metrics.jsonl logs)."""
    if run_dir is None or not spec.tracking.backends:
        return None
    context = TrackerContext(Path(run_dir), job_id, spec.name, spec.tracking)
    config: dict[str, Any] = {"job_id": job_id, **spec.model_dump(mode="json")}
    return TrackerHub(spec.tracking.backends, context, config, on_error=on_error,
                      on_drop=on_drop)
