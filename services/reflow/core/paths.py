"""Path confinement: every path that arrives in a job spec or an RPC must lie
under a root the operator configured, and is refused, naming its field,
otherwise.

Three roots: runs (`REFLOW_RUNS_DIR`: run directories, metrics, checkpoints,
logs), models (`REFLOW_MODELS_DIR`: model directories) and datasets
(`REFLOW_DATASETS_DIR`: the files a task reads its prompts from). A path is resolved
the way the operating system would open it, `..` and symlinks included, and
must then lie strictly below its root; a relative path is taken relative to
the root. Each service checks with its own roots on its own filesystem, so a
symlink planted on a worker's volume is caught where it would be followed.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

RUNS_ROOT_ENV = "REFLOW_RUNS_DIR"
MODELS_ROOT_ENV = "REFLOW_MODELS_DIR"
DATASETS_ROOT_ENV = "REFLOW_DATASETS_DIR"
DEFAULT_RUNS_ROOT = "runs"
DEFAULT_MODELS_ROOT = ".reflow/models"
DEFAULT_DATASETS_ROOT = ".reflow/datasets"


def confine(path: str | os.PathLike[str], root: str | os.PathLike[str], field: str,
            root_env: str = "") -> Path:
    """`path` resolved (symlinks followed), if it lies strictly below `root`;
    otherwise a ValueError that names `field` and the root."""
    text = os.fspath(path)
    if not text or "\x00" in text:
        raise ValueError(f"{field}: must be a non-empty path without NUL bytes")
    real_root = Path(os.path.realpath(root))
    candidate = Path(text) if os.path.isabs(text) else real_root / text
    real = Path(os.path.realpath(candidate))
    if real == real_root or not real.is_relative_to(real_root):
        where = f" ({root_env})" if root_env else ""
        raise ValueError(f"{field}: {text!r} is outside the allowed root {real_root}{where}; "
                         "give a path below it, with no '..' or symlink leading out")
    return real


@dataclass(frozen=True)
class PathRoots:
    """The operator's roots; `from_env` reads them as `reflow serve` does."""

    runs: Path
    models: Path
    datasets: Path = Path(DEFAULT_DATASETS_ROOT).absolute()

    @classmethod
    def from_env(cls) -> PathRoots:
        return cls(runs=Path(os.environ.get(RUNS_ROOT_ENV) or DEFAULT_RUNS_ROOT).absolute(),
                   models=Path(os.environ.get(MODELS_ROOT_ENV) or DEFAULT_MODELS_ROOT).absolute(),
                   datasets=datasets_root())

    def run_dir(self, path: str | os.PathLike[str], field: str = "run_dir") -> Path:
        return confine(path, self.runs, field, RUNS_ROOT_ENV)

    def model_dir(self, path: str | os.PathLike[str], field: str = "model.path") -> Path:
        return confine(path, self.models, field, MODELS_ROOT_ENV)


def datasets_root() -> Path:
    """The operator's datasets root, as `reflow serve` reads it."""
    return Path(os.environ.get(DATASETS_ROOT_ENV) or DEFAULT_DATASETS_ROOT).absolute()


def dataset_file(path: str | os.PathLike[str], root: str | os.PathLike[str], field: str) -> Path:
    """A dataset file a spec names: confined under the datasets root, and a file."""
    real = confine(path, root, field, DATASETS_ROOT_ENV)
    if not real.is_file():
        raise ValueError(f"{field}: {os.fspath(path)!r} is not a file under the datasets root "
                         f"{os.path.realpath(root)} ({DATASETS_ROOT_ENV})")
    return real


# host:port, optionally after the DNS server that resolves the host
# (`dns://10.96.0.10:53/name:port`, gRPC's target syntax).
_ADDRESS = re.compile(r"(dns://[A-Za-z0-9._\-\[\]:]{1,253}/)?[A-Za-z0-9._\-\[\]:]{1,253}:[0-9]{1,5}")


_HOST = re.compile(r"[A-Za-z0-9._\-\[\]:]{1,253}")


def check_host(host: str, field: str) -> str:
    """A host an RPC names for this service to connect to: a name or an IP."""
    if not _HOST.fullmatch(host):
        raise ValueError(f"{field}: {host[:80]!r} is not a host name or IP address")
    return host


def check_address(address: str, field: str) -> str:
    """A `host:port` that an RPC names for this service to call: a name or an IP
    and a port, nothing else (no scheme but `dns://<server>/`, no path or user part)."""
    if not _ADDRESS.fullmatch(address) or not 1 <= int(address.rpartition(":")[2]) <= 65535:
        raise ValueError(f"{field}: {address[:80]!r} is not a host:port address")
    return address
