"""Model directories a job trains: built from a preset (`tiny.py`) or imported
from a GGUF file (`gguf.py`). This module owns what both builders share: one
build of a directory at a time, across threads and processes, and the first
import of transformers. It knows nothing of presets or file formats.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
from collections.abc import Iterator
from pathlib import Path

_import_lock = threading.Lock()
_build_lock = threading.Lock()


def import_transformers():
    """Import transformers, the first time under a process-wide lock, and return it.

    Its first import must not run in two threads at once. transformers replaces its
    own module in sys.modules with a lazy module at the end of its __init__; a
    thread that asked for it meanwhile waits for the import, but CPython then hands
    it the object it found before waiting, which has none of the lazy names, and
    `from transformers import AutoConfig` fails with ImportError (seen when the
    scheduler's job threads prepared two jobs at once). Once imported, reads from
    any thread are safe."""
    with _import_lock:
        import transformers
    return transformers


@contextlib.contextmanager
def build_lock(target: str | os.PathLike[str]) -> Iterator[None]:
    """Held while the model directory `target` is built. Other threads of this
    process (the scheduler's job threads) and other processes (a trainer and a
    rollout worker, or two worker pods, on one models volume) wait; each then
    finds the directory complete and builds nothing. A flock on a hidden file
    beside the target, which the kernel drops if its holder dies. The holder
    removes the file as it lets go, so none is left beside the model; a waiter
    that then holds the lock of a file no longer at that path locks again."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    path = target.parent / f".{target.name}.lock"
    with _build_lock:
        while True:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                held = os.stat(path).st_ino == os.fstat(fd).st_ino
            except FileNotFoundError:
                held = False
            if held:
                break
            os.close(fd)
        try:
            yield
        finally:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
            os.close(fd)  # releases the flock
