"""Same-host hand-off of the trainer state to a joining replica (paper §5).

A replica that joins the data-parallel group needs the leader's parameters and
AdamW moments: three times the model. Across hosts they travel by broadcast
over the group (dp.TrainerGroup.broadcast_state; NCCL on GPU). On CPU, gloo
moves them over loopback TCP at about 0.5 GB/s on a small machine, so a
worker that flips to trainer would spend seconds receiving what already sits
in memory on the same host.

So on CPU the leader keeps its parameters and optimizer state in one
anonymous shared-memory file (memfd), and every training step updates them
there in place. A replica on the same host maps that file read-only at the
sync boundary, when the leader is waiting for the new group and the state
holds still, and copies it into its own tensors: one memcpy instead of a
network transfer. It is the CPU counterpart of the CUDA IPC hand-off that
GPU systems use between processes of one node.

The leader names the file by its process id and descriptor number; nothing
else it sends is opened. A replica checks before it copies that the path is
/proc/<pid>/fd/<fd>, that it is a memfd of this kind owned by its own user,
of the announced size, holding the announced random token, and that the
layout (every tensor's dtype and shape, in order) is its own model's. Any
mismatch (another host, another PID namespace, another model) falls back to
the broadcast.
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import re
import secrets
import stat
import warnings
from dataclasses import dataclass

import torch

MEMFD_NAME = "reflow-trainer-state"
TOKEN_BYTES = 16
ALIGN = 64
# A descriptor is a few hundred bytes; anything larger is not one.
MAX_DESCRIPTOR_BYTES = 4096
_HEX = re.compile(r"^[0-9a-f]+$")


def _aligned(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def layout_digest(tensors: list[torch.Tensor]) -> str:
    """What both sides must agree on before bytes are copied: every tensor's
    dtype and shape, in the agreed order."""
    text = ";".join(f"{t.dtype}:{tuple(t.shape)}" for t in tensors)
    return hashlib.sha256(text.encode()).hexdigest()


def materialise_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """Create AdamW's per-parameter state where the optimizer has not yet made it,
    with the values its first step would start from (step 0, zero moments), so
    that every replica has the same tensors to broadcast into."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            state = optimizer.state[p]
            if state:
                continue
            state["step"] = torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)


def _state_slots(model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer) -> list[tuple[object, str | None]]:
    """Where each state tensor lives, in the order every replica agrees on:
    parameters (`.data`, key None), then each parameter's optimizer-state tensors.
    Trainable parameters only: a frozen one (LoRA's base weights) is model.path's
    on every rank, so a role flip moves a LoRA job's adapters and their AdamW state
    alone."""
    materialise_optimizer_state(optimizer)
    params = [p for p in model.parameters() if p.requires_grad]
    slots: list[tuple[object, str | None]] = [(p, None) for p in params]
    for p in params:
        state = optimizer.state[p]
        slots.extend((state, k) for k in sorted(state) if isinstance(state[k], torch.Tensor))
    return slots


def state_tensors(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Parameters then optimizer state, in an order every replica agrees on."""
    return [owner.data if key is None else owner[key]  # type: ignore[index,attr-defined]
            for owner, key in _state_slots(model, optimizer)]


@dataclass(frozen=True)
class Descriptor:
    pid: int
    fd: int
    size: int
    token: str
    layout: str

    def encode(self) -> bytes:
        return json.dumps(self.__dict__).encode()

    @classmethod
    def decode(cls, raw: bytes) -> Descriptor:
        """Validate a descriptor received from the leader; ValueError if it is not one."""
        if not raw or len(raw) > MAX_DESCRIPTOR_BYTES:
            raise ValueError("no state hand-off descriptor")
        data = json.loads(raw)
        if not isinstance(data, dict) or set(data) != {"pid", "fd", "size", "token", "layout"}:
            raise ValueError("state hand-off descriptor: unexpected fields")
        pid, fd, size = data["pid"], data["fd"], data["size"]
        token, layout = data["token"], data["layout"]
        if not all(isinstance(v, int) and not isinstance(v, bool) for v in (pid, fd, size)):
            raise ValueError("state hand-off descriptor: pid, fd and size must be integers")
        if not (0 < pid < 1 << 22 and 0 <= fd < 1 << 20 and 0 < size < 1 << 40):
            raise ValueError("state hand-off descriptor: pid, fd or size out of range")
        if not (isinstance(token, str) and len(token) == 2 * TOKEN_BYTES and _HEX.match(token)
                and isinstance(layout, str) and len(layout) == 64 and _HEX.match(layout)):
            raise ValueError("state hand-off descriptor: malformed token or layout")
        return cls(pid, fd, size, token, layout)


class SharedState:
    """The leader's parameters and optimizer state, moved into one memfd.

    After `share`, each parameter's `.data` and each optimizer-state tensor is a
    view into the shared file; the optimizer updates them in place, so the file
    always holds the current state. `close` moves them back to private memory
    (before a checkpoint is written, and at the end of the job)."""

    def __init__(self, tensors: list[torch.Tensor]) -> None:
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.layout = layout_digest(tensors)
        offsets, offset = [], _aligned(TOKEN_BYTES)
        for t in tensors:
            offsets.append(offset)
            offset = _aligned(offset + t.numel() * t.element_size())
        self.size = offset
        self.fd = os.memfd_create(MEMFD_NAME, os.MFD_CLOEXEC)
        try:
            os.ftruncate(self.fd, self.size)
            self._map = mmap.mmap(self.fd, self.size, mmap.MAP_SHARED,
                                  mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError:
            os.close(self.fd)
            raise
        self._map[:TOKEN_BYTES] = self.token
        self._bytes = torch.frombuffer(self._map, dtype=torch.uint8)
        self.views = [self._view(t, o) for t, o in zip(tensors, offsets)]
        with torch.no_grad():
            for view, t in zip(self.views, tensors):
                view.copy_(t)

    def _view(self, like: torch.Tensor, offset: int) -> torch.Tensor:
        nbytes = like.numel() * like.element_size()
        return self._bytes[offset:offset + nbytes].view(like.dtype).view(like.shape)

    def descriptor(self) -> Descriptor:
        return Descriptor(os.getpid(), self.fd, self.size, self.token.hex(), self.layout)

    @classmethod
    def share(cls, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> SharedState:
        """Move `model`'s parameters and `optimizer`'s state into a new shared file."""
        tensors = state_tensors(model, optimizer)
        shared = cls(tensors)
        shared._rebind(model, optimizer, shared.views)
        return shared

    @staticmethod
    def _rebind(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                tensors: list[torch.Tensor]) -> None:
        """Point parameters and optimizer state at `tensors`, in state_tensors order."""
        for (owner, key), tensor in zip(_state_slots(model, optimizer), tensors, strict=True):
            if key is None:
                owner.data = tensor  # type: ignore[attr-defined]
            else:
                owner[key] = tensor  # type: ignore[index]

    def close(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Give every tensor private memory again and release the shared file."""
        with torch.no_grad():
            private = [t.clone() for t in state_tensors(model, optimizer)]
        self._rebind(model, optimizer, private)
        self.views = []
        del self._bytes
        try:
            self._map.close()
        except BufferError:
            # A tensor somewhere still views the file; the mapping goes with it.
            pass
        os.close(self.fd)


def copy_from_leader(descriptor: Descriptor, tensors: list[torch.Tensor]) -> None:
    """Copy the leader's shared state into `tensors` (same order and layout).
    Raises OSError or ValueError when the file is not the leader's on this host."""
    if layout_digest(tensors) != descriptor.layout:
        raise ValueError("the leader's state has another layout (another model?)")
    path = f"/proc/{descriptor.pid}/fd/{descriptor.fd}"
    if not os.readlink(path).startswith(f"/memfd:{MEMFD_NAME} "):
        raise ValueError(f"{path} is not a trainer-state memfd")
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_uid != os.getuid():
            raise ValueError(f"{path} is not a regular file of this user")
        if info.st_size != descriptor.size:
            raise ValueError(f"{path} holds {info.st_size} bytes, not {descriptor.size}")
        flags = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)
        with mmap.mmap(fd, descriptor.size, flags, mmap.PROT_READ) as mapped:
            if mapped[:TOKEN_BYTES].hex() != descriptor.token:
                raise ValueError(f"{path} does not hold the announced token")
            _copy_out(mapped, tensors)
    finally:
        os.close(fd)


def _copy_out(mapped: mmap.mmap, tensors: list[torch.Tensor]) -> None:
    view = memoryview(mapped)
    try:
        offset = _aligned(TOKEN_BYTES)
        with torch.no_grad(), warnings.catch_warnings():
            # The mapping is read-only and torch says so; it is only read from.
            warnings.filterwarnings("ignore", message=".*not writable.*")
            for t in tensors:
                source = torch.frombuffer(view, dtype=t.dtype, count=t.numel(), offset=offset)
                t.copy_(source.view(t.shape))
                del source
                offset = _aligned(offset + t.numel() * t.element_size())
    finally:
        view.release()
