"""Trainer checkpoints at the trained point, and resuming from them.

A checkpoint is one directory under `<run_dir>/checkpoints/`, `step-<N>`:

    .metadata, *.distcp   model and optimizer state and the RNG, written with
                          torch.distributed.checkpoint (DCP)
    state.json            step, policy version, the buffer ledger at that step
    COMMITTED             written last, after everything above is on disk

A directory without `COMMITTED` is a save that did not finish (the trainer died
mid-write): it is never loaded, and the next retention pass removes it. This is
prime-rl's `STABLE` marker; a reader sees a whole checkpoint or none.

Saving is asynchronous (DCP `async_save`): the step that triggers it pays only
for staging, a copy of the state in host memory; the write and the commit run
on a thread of their own while training goes on. At most one save is in flight:
a second waits for the first, so the staged copies never pile up.

The ledger (`state.json`'s `ledger`) is the replay buffer's counters read right
after the step's lease was released: every sample dispatched by then is in
flight, pooled, trained, evicted or dropped. On a resume with the buffer still
alive, the samples trained after the checkpoint stay trained (their steps are
the ones lost); nothing is handed out twice as fresh, because the buffer's own
state, not the checkpoint, says what is pooled.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import threading
import time
import warnings
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

# DCP warns on every call made without a process group; this trainer's leader
# saves alone by design (its replicas hold the same state).
warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or "
                        "uninitialized", category=UserWarning)

CHECKPOINTS_DIR = "checkpoints"
COMMIT_MARKER = "COMMITTED"
STATE_FILE = "state.json"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"step-([0-9]{8})")
# state.json is a few kilobytes; anything much larger is not ours.
MAX_STATE_BYTES = 1 << 20


class CheckpointError(ValueError):
    """A checkpoint that cannot be resumed from; the message says why and what to do."""


@dataclass
class CheckpointInfo:
    path: Path
    step: int
    policy_version: int
    state: dict[str, Any]


def step_dir(root: Path, step: int) -> Path:
    return root / f"step-{step:08d}"


def committed(root: Path) -> list[Path]:
    """Committed checkpoints under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir()
             if (m := _STEP_DIR.fullmatch(p.name)) and p.is_dir() and not p.is_symlink()
             and (p / COMMIT_MARKER).is_file()]
    return [p for _, p in sorted(found)]


def read_checkpoint(path: Path) -> CheckpointInfo:
    """A committed checkpoint's state, checked: CheckpointError when `path` is not
    a checkpoint, has no commit marker, or its state is unreadable."""
    if not path.is_dir():
        raise CheckpointError(f"{path}: no such checkpoint directory")
    if not (path / COMMIT_MARKER).is_file():
        raise CheckpointError(f"{path}: not committed (no {COMMIT_MARKER} marker: its save "
                              "did not finish); resume from an earlier checkpoint")
    state_path = path / STATE_FILE
    if (not state_path.is_file() or state_path.is_symlink()
            or state_path.stat().st_size > MAX_STATE_BYTES or not (path / ".metadata").is_file()):
        raise CheckpointError(f"{path}: {STATE_FILE} or the DCP .metadata is missing; "
                              "the directory is not a ReFlow checkpoint")
    try:
        state = json.loads(state_path.read_text())
        step, version = int(state["step"]), int(state["policy_version"])
        fmt = int(state.get("format", 0))
    except (ValueError, KeyError, TypeError) as err:
        raise CheckpointError(f"{state_path}: unreadable ({err}); the checkpoint is corrupt, "
                              "resume from an earlier one") from None
    if fmt != FORMAT_VERSION:
        raise CheckpointError(f"{state_path}: format {fmt}, this trainer reads format "
                              f"{FORMAT_VERSION}")
    if step < 1 or version < 0:
        raise CheckpointError(f"{state_path}: step {step} / policy_version {version} out of range")
    return CheckpointInfo(path, step, version, state)


def latest_checkpoint(run_dir: Path) -> CheckpointInfo | None:
    """The newest committed checkpoint of a run, or None. A newest one that does not
    read is skipped for the one before it (logged): a torn state.json must not
    strand a job whose previous checkpoint is whole."""
    for path in reversed(committed(run_dir / CHECKPOINTS_DIR)):
        try:
            return read_checkpoint(path)
        except CheckpointError as err:
            logger.warning("skipping checkpoint %s: %s", path, err)
    return None


def check_resume_dir(run_dir: Path) -> CheckpointInfo:
    """What `--resume RUN_DIR` continues from; CheckpointError, before anything
    starts, for a directory that is not a run or holds no committed checkpoint."""
    if not run_dir.is_dir():
        raise CheckpointError(f"--resume {run_dir}: no such run directory")
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        raise CheckpointError(f"--resume {run_dir}: no {CHECKPOINTS_DIR}/ directory; it is not "
                              "a ReFlow run directory, or its job never reached "
                              "trainer.checkpoint_interval steps")
    paths = committed(root)
    if not paths:
        raise CheckpointError(f"--resume {run_dir}: no committed checkpoint in {root} (a "
                              f"checkpoint without {COMMIT_MARKER} is never loaded)")
    info = latest_checkpoint(run_dir)
    if info is None:
        raise CheckpointError(f"--resume {run_dir}: every checkpoint in {root} is corrupt")
    return info


def _frozen_from_model_path(loading: bool = False):
    """Frozen parameters (LoRA's base weights) are left out of the state saved and
    loaded: they come from model.path. Loading, the model's own state then lacks
    them, which `strict` would refuse; every key the checkpoint should hold is
    still checked, by DCP's load of the template."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return StateDictOptions(ignore_frozen_params=True, strict=not loading)


def _training_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    from torch.distributed.checkpoint.state_dict import get_state_dict

    # A LoRA checkpoint holds the adapters and their AdamW state only.
    model_state, optim_state = get_state_dict(model, optimizer,
                                              options=_frozen_from_model_path())
    return {"model": model_state, "optimizer": optim_state,
            "rng": {"torch": torch.get_rng_state()}}


def load_checkpoint(info: CheckpointInfo, model: torch.nn.Module,
                    optimizer: torch.optim.Optimizer) -> None:
    """Load a committed checkpoint's model, optimizer and RNG in place."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict import set_state_dict

    # The templates DCP loads into: this model's and optimizer's own state (an
    # optimizer that never stepped gets its state allocated here, by torch).
    state = _training_state(model, optimizer)
    try:
        dcp.load(state, checkpoint_id=str(info.path), no_dist=True)
    # DCP's CheckpointException is a BaseException, not an Exception.
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - many types, one cause
        raise CheckpointError(f"{info.path}: does not load into this model ({err}); was it "
                              "written for another model.path?") from err
    set_state_dict(model, optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optimizer"],
                   options=_frozen_from_model_path(loading=True))
    torch.set_rng_state(state["rng"]["torch"])


def write_shards(path: Path, root: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank of an FSDP group: its shards of the model and optimizer state
    into checkpoint directory `path`, under the model's own names, so the
    checkpoint loads at any world size and into a replicated trainer too (a
    collective: every rank calls it with the same path, on storage they share)."""
    import torch.distributed.checkpoint as dcp

    from reflow.trainer.fsdp import policy_state

    model_state, optim_state = policy_state(root, optimizer)
    dcp.save({"model": model_state, "optimizer": optim_state,
              "rng": {"torch": torch.get_rng_state()}}, checkpoint_id=str(path))


def load_shards(path: Path, root: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Every rank of an FSDP group: its shards from a committed checkpoint of any
    world size, sharded or replicated (DCP re-shards on load)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    from reflow.trainer.fsdp import load_policy_state, policy_state

    model_state, optim_state = policy_state(root, optimizer)
    state = {"model": model_state, "optimizer": optim_state,
             "rng": {"torch": torch.get_rng_state()}}
    try:
        dcp.load(state, checkpoint_id=str(path))
    except (Exception, CheckpointException) as err:  # noqa: BLE001 - many types, one cause
        raise CheckpointError(f"{path}: does not load into this model's shards ({err})") from err
    load_policy_state(root, optimizer, state["model"], state["optimizer"])
    torch.set_rng_state(state["rng"]["torch"])


def check_shard_dir(arg: str) -> Path:
    """A replica's check of the checkpoint directory its leader names: a step
    directory under a run's checkpoints/ that this replica sees (fsdp
    checkpoints need the run directory on storage every trainer mounts)."""
    path = Path(arg)
    if (not path.is_absolute() or ".." in path.parts or not _STEP_DIR.fullmatch(path.name)
            or path.parent.name != CHECKPOINTS_DIR):
        raise ValueError(f"checkpoint: {arg[:200]!r} is not a run's checkpoints/step-N "
                         "directory")
    if not path.is_dir() or path.is_symlink():
        raise CheckpointError(f"checkpoint: {path} is not on this trainer's filesystem; "
                              "trainer.parallelism: fsdp writes each rank's shards into the "
                              "leader's run directory, which every trainer must mount")
    return path


class Checkpointer:
    """Saves a run's checkpoints every `interval` steps, asynchronously, and keeps
    the last `keep_last`. `observe(bytes, write_s, stage_s)`, if given, receives
    each committed save's size and times. `resumed_step`: the checkpoint the run
    resumed from, the latest committed until this one commits another."""

    def __init__(self, run_dir: Path, interval: int, keep_last: int,
                 observe=None, resumed_step: int = 0) -> None:
        self.root = run_dir / CHECKPOINTS_DIR
        self.interval = interval
        self.keep_last = keep_last
        self.observe = observe
        self._pending: Future | None = None
        self._lock = threading.Lock()
        self.last_committed_step = resumed_step
        self.last: dict[str, float] = {}
        self.error = ""

    def due(self, step: int) -> bool:
        return self.interval > 0 and step % self.interval == 0

    def save(self, step: int, policy_version: int, model: torch.nn.Module,
             optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> float:
        """Stage the state now and write it in the background; returns the seconds
        the caller spent (staging, plus any wait for the previous save)."""
        import torch.distributed.checkpoint as dcp

        started = time.monotonic()
        path = self.prepare(step)
        state = _training_state(model, optimizer)
        # Staging copies the tensors before async_save returns, so the next
        # optimizer step cannot tear what is being written.
        future = dcp.async_save(state, checkpoint_id=str(path), no_dist=True)
        upload = getattr(future, "upload_completion", future)
        stage_s = time.monotonic() - started
        record = {"format": FORMAT_VERSION, "step": step, "policy_version": policy_version,
                  "created_at": time.time(), **extra}
        done: Future = Future()
        threading.Thread(target=self._commit, args=(path, upload, record, started, stage_s, done),
                         name="checkpoint-commit", daemon=True).start()
        with self._lock:
            self._pending = done
        return stage_s

    def prepare(self, step: int) -> Path:
        """The empty directory of step `step`'s checkpoint, once the previous save
        has committed."""
        self.wait()
        path = step_dir(self.root, step)
        if path.exists():  # a save of this step that died part-way: start over
            shutil.rmtree(path)
        path.mkdir(parents=True)
        return path

    def save_sharded(self, path: Path, step: int, policy_version: int, root: torch.nn.Module,
                     optimizer: torch.optim.Optimizer, extra: dict[str, Any]) -> float:
        """The leader's part of an FSDP group's save into `path` (`prepare`), which
        every replica writes with it (`write_shards`): its own shards, then the
        commit once the collective is done. Synchronous: DCP's asynchronous save
        would run its final collective on a thread beside training's, on the same
        group. Returns the seconds it took."""
        started = time.monotonic()
        write_shards(path, root, optimizer)
        written: Future = Future()
        written.set_result(None)
        record = {"format": FORMAT_VERSION, "step": step, "policy_version": policy_version,
                  "created_at": time.time(), "sharded": True, **extra}
        done: Future = Future()
        with self._lock:
            self._pending = done
        self._commit(path, written, record, started, time.monotonic() - started, done)
        return time.monotonic() - started

    def _commit(self, path: Path, upload, record: dict, started: float, stage_s: float,
                done: Future) -> None:
        try:
            upload.result()
            _write_durably(path / STATE_FILE, json.dumps(record, indent=1).encode())
            size = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
            write_s = time.monotonic() - started
            # The marker last: from here on the checkpoint may be loaded.
            _write_durably(path / COMMIT_MARKER,
                           json.dumps({"bytes": size, "write_s": round(write_s, 3)}).encode())
            _fsync_dir(path.parent)
            self.last_committed_step = record["step"]
            self.last = {"last_checkpoint_bytes": float(size),
                         "last_checkpoint_write_s": write_s,
                         "last_checkpoint_stage_s": stage_s}
            if self.observe is not None:
                self.observe(size, write_s, stage_s)
            logger.info("checkpoint step %d committed: %.1f MB in %.2fs (%.3fs staging)",
                        record["step"], size / 1e6, write_s, stage_s)
            self._retain()
            done.set_result(path)
        except BaseException as err:  # noqa: BLE001 - reported, the job goes on
            self.error = f"{type(err).__name__}: {err}"
            logger.exception("checkpoint %s failed; the previous one stays the latest", path)
            done.set_exception(err)

    def _retain(self) -> None:
        """Keep the newest `keep_last` committed checkpoints; drop older ones and
        any uncommitted directory older than the newest committed one."""
        keep = committed(self.root)[-self.keep_last:]
        newest = int(keep[-1].name[5:]) if keep else 0
        for p in self.root.iterdir():
            m = _STEP_DIR.fullmatch(p.name)
            if m is None or p in keep or p.is_symlink():
                continue
            if (p / COMMIT_MARKER).is_file() or int(m.group(1)) < newest:
                shutil.rmtree(p, ignore_errors=True)

    def wait(self, timeout_s: float | None = None) -> Path | None:
        """Block until the save in flight (if any) is committed or failed."""
        with self._lock:
            pending = self._pending
        if pending is None:
            return None
        try:
            return pending.result(timeout_s)
        except Exception:  # noqa: BLE001 - logged in _commit; self.error holds it
            return None


def _write_durably(path: Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def supersede_metrics(run_dir: Path, step: int) -> int:
    """Move the records of steps after `step` out of `<run_dir>/metrics.jsonl` into
    `metrics.superseded.jsonl` (kept for the post-mortem): a resumed job trains
    those steps again, and its curve must show each step once. Returns the
    records moved."""
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return 0
    kept, moved = [], []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        try:
            later = int(json.loads(line).get("step", 0)) > step
        except (ValueError, AttributeError):
            later = True  # a line torn by a kill mid-write: out of the curve
        (moved if later else kept).append(line)
    if moved:
        with open(run_dir / "metrics.superseded.jsonl", "a") as f:
            f.write("\n".join(moved) + "\n")
        _write_durably(path, ("\n".join(kept) + "\n" if kept else "").encode())
    return len(moved)
