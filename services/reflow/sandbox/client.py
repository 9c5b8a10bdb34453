"""How tasks and environments reach the sandbox: one interface, a gRPC
implementation for the sandbox service (`GrpcSandboxClient`) and an in-process
one over a `SandboxService` (`LocalSandboxClient`) for tests and single-process
tools.

Which sandbox a process uses is the operator's setting, never the job spec's:
REFLOW_SANDBOX_ADDRESS (host:port of the sandbox Service; `reflow run` and the
chart set it on rollout workers). `default_client()` returns the process's one
client, built on first use."""

from __future__ import annotations

import abc
import os
import threading

from reflow.sandbox.types import ExecRequest, ExecResult

ADDRESS_ENV = "REFLOW_SANDBOX_ADDRESS"


class SandboxClient(abc.ABC):
    @abc.abstractmethod
    def execute(self, request: ExecRequest, job_id: str = "") -> ExecResult:
        """Run one program and wait for its result. ValueError for a request the
        service refuses (naming the field); core.errors.Unavailable when no
        sandbox answers."""

    def close(self) -> None:
        pass


class LocalSandboxClient(SandboxClient):
    """The sandbox in this process: executions isolated exactly as the service
    isolates them (reflow.sandbox.service), without a network hop."""

    def __init__(self, service) -> None:
        self.service = service

    def execute(self, request: ExecRequest, job_id: str = "") -> ExecResult:
        return self.service.execute(request)

    def close(self) -> None:
        self.service.close()


_default: SandboxClient | None = None
_default_lock = threading.Lock()


def default_client() -> SandboxClient:
    """The process's sandbox client: the service at REFLOW_SANDBOX_ADDRESS, or the
    one `set_default_client` installed. ValueError saying what to set otherwise."""
    global _default
    with _default_lock:
        if _default is None:
            address = os.environ.get(ADDRESS_ENV, "").strip()
            if not address:
                raise ValueError(f"this task runs code in the sandbox, and no sandbox is "
                                 f"configured: set {ADDRESS_ENV} to the sandbox service's "
                                 "host:port (`reflow run` starts one for such a task; the "
                                 "chart sets it when sandbox.enabled)")
            from reflow.sandbox.grpc_client import GrpcSandboxClient

            _default = GrpcSandboxClient(address)
        return _default


def set_default_client(client: SandboxClient | None) -> SandboxClient | None:
    """Install `client` as the process's sandbox (None: back to the setting);
    returns the one it replaces."""
    global _default
    with _default_lock:
        previous, _default = _default, client
        return previous
