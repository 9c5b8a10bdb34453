"""The tracking section of the job spec: which experiment trackers (TensorBoard,
MLflow, Weights & Biases) follow the run, and the registry of tracker names.

A spec only *names* a tracker. The names are the built-ins (registered as entry
points in group `reflow.trackers` by this package), entry points other installed
packages add to that group, and trackers registered in-process with
`register_tracker` (an embedding program or a test). Nothing is imported by a
name taken from the spec; a built-in whose package is not installed is refused
here, at validation. Secrets never appear in the spec: the W&B key and an MLflow
server's URI or token come from the trainer's environment.

This module imports no tracker package (it only asks whether one is installed)
and knows nothing of what a tracker writes: `reflow.tracking` does.
"""

from __future__ import annotations

import functools
import importlib.util
from importlib.metadata import entry_points
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from reflow.core.sections import _Section

TRACKER_GROUP = "reflow.trackers"
INSTALL_HINT = "pip install 'reflow[trackers]'"

# The built-ins: the class each name loads (fixed here, never from a spec; the
# same references are the package's entry points) and the module it needs.
BUILTIN_TRACKERS: dict[str, tuple[str, str]] = {
    "tensorboard": ("reflow.tracking.tensorboard:TensorBoardTracker", "tensorboard"),
    "mlflow": ("reflow.tracking.mlflow:MlflowTracker", "mlflow"),
    "wandb": ("reflow.tracking.wandb:WandbTracker", "wandb"),
}

# Trackers registered in-process: name -> a class (or factory) taking a TrackerContext.
_IN_PROCESS: dict[str, Any] = {}


def register_tracker(name: str, factory: Any) -> None:
    """Make `name` a tracker a spec may use, in this process only: `factory` is
    called with a `reflow.tracking.TrackerContext` and returns a `Tracker`. For a
    program that embeds the trainer, and for tests; an operator's image uses an
    entry point in group `reflow.trackers` instead."""
    if name in BUILTIN_TRACKERS:
        raise ValueError(f"tracker {name!r} is a built-in; choose another name")
    if not callable(factory):
        raise TypeError(f"tracker {name!r}: the factory must be callable")
    _IN_PROCESS[name] = factory


def unregister_tracker(name: str) -> None:
    """Forget a tracker `register_tracker` added (no error when it is not there)."""
    _IN_PROCESS.pop(name, None)


@functools.cache
def installed_entry_points() -> dict[str, Any]:
    """Entry points of group `reflow.trackers`, read once per process."""
    return {ep.name: ep for ep in entry_points(group=TRACKER_GROUP)}


def tracker_names() -> list[str]:
    """Every tracker name a spec may use, sorted."""
    return sorted({*BUILTIN_TRACKERS, *installed_entry_points(), *_IN_PROCESS})


def in_process_tracker(name: str) -> Any | None:
    return _IN_PROCESS.get(name)


def missing_package(name: str) -> str | None:
    """The module a built-in tracker needs that is not installed, else None."""
    if name not in BUILTIN_TRACKERS:
        return None
    module = BUILTIN_TRACKERS[name][1]
    return None if importlib.util.find_spec(module) is not None else module


class TrackingConfig(_Section):
    """Experiment trackers that follow the run beside `metrics.jsonl`."""

    backends: list[str] = Field(
        default_factory=list, max_length=8,
        description="Trackers to log to: `tensorboard` (event files in <run_dir>/tensorboard), "
        "`mlflow` (a local store in <run_dir>/mlflow unless a tracking URI is given), "
        "`wandb` (an offline run in <run_dir>/wandb unless wandb_mode is online); "
        "operators add more as entry points in group `reflow.trackers`. Empty: off.")
    generations_interval: int = Field(
        default=10, ge=0, le=1_000_000,
        description="Every this many steps, log a table of the batch's sampled generations "
        "(prompt, response, reward, policy version). 0: never.")
    generations_per_table: int = Field(
        default=8, ge=1, le=256, description="Rows of a generations table at most.")
    generations_max_chars: int = Field(
        default=2000, ge=16, le=65_536,
        description="A prompt or response longer than this many characters is cut to it "
        "in a generations table.")
    mlflow_tracking_uri: str | None = Field(
        default=None, min_length=1, max_length=2048,
        description="MLflow tracking server (`http://mlflow:5000`; http or https only: a "
        "spec names no path on the trainer's machine). None: a "
        "local file store in <run_dir>/mlflow. The trainer's REFLOW_MLFLOW_TRACKING_URI or "
        "MLFLOW_TRACKING_URI, when set, takes precedence; credentials go in the "
        "environment (MLFLOW_TRACKING_TOKEN), never here.")
    mlflow_experiment: str | None = Field(
        default=None, min_length=1, max_length=256,
        description="MLflow experiment the run is logged under. None: the job's name.")
    wandb_project: str = Field(
        default="reflow", min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$",
        description="Weights & Biases project.")
    wandb_mode: Literal["offline", "online"] = Field(
        default="offline",
        description="`offline`: the run is written to <run_dir>/wandb, to upload later with "
        "`wandb sync`; `online`: streamed to W&B, which needs WANDB_API_KEY in the trainer's "
        "environment (without it the W&B tracker is disabled with a warning).")
    queue_size: int = Field(
        default=1024, ge=1, le=100_000,
        description="Records waiting for the trackers at most; past it a record is dropped "
        "(and counted) rather than slowing training.")
    close_timeout_s: float = Field(
        default=60.0, ge=0.0, le=3600.0,
        description="At the job's end, how long the trackers may take to flush what is queued.")

    @field_validator("backends")
    @classmethod
    def _known_and_installed(cls, names: list[str]) -> list[str]:
        seen: set[str] = set()
        for name in names:
            if name in seen:
                raise ValueError(f"tracking.backends: {name!r} is listed twice")
            seen.add(name)
            if name not in tracker_names():
                hint = (" (module paths are not accepted: an operator registers a tracker as "
                        f"an entry point in group {TRACKER_GROUP!r})"
                        if ":" in name or "." in name else "")
                raise ValueError(f"tracking.backends: unknown tracker {name!r}{hint}; "
                                 f"registered: {', '.join(tracker_names())}")
            if missing_package(name):
                raise ValueError(f"tracking.backends: {name} is not installed ({INSTALL_HINT})")
        return names

    @field_validator("mlflow_tracking_uri")
    @classmethod
    def _no_credentials(cls, uri: str | None) -> str | None:
        if uri is None:
            return uri
        scheme = urlsplit(uri).scheme.lower()
        if scheme not in ("http", "https") or not urlsplit(uri).hostname:
            # A file: or sqlite: URI would write wherever the trainer can; the local
            # store is the run directory's, and an operator who wants another sets
            # REFLOW_MLFLOW_TRACKING_URI on the trainer.
            raise ValueError(f"tracking.mlflow_tracking_uri: {scheme or 'no'} scheme; a spec "
                             "names an MLflow server (http:// or https:// with a host). Leave "
                             "it unset for a local store in the run directory; the operator "
                             "sets REFLOW_MLFLOW_TRACKING_URI for any other store")
        if urlsplit(uri).username or urlsplit(uri).password:
            raise ValueError("tracking.mlflow_tracking_uri: credentials do not belong in the "
                             "spec; give them to the trainer as MLFLOW_TRACKING_USERNAME/"
                             "MLFLOW_TRACKING_PASSWORD or MLFLOW_TRACKING_TOKEN")
        return uri
