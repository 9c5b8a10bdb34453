"""The trainer role as a data-parallel group (paper §5, elastic resource pool).

Rank 0, the leader, leases each batch from the buffer and broadcasts it to the
replicas; every rank computes the gradient of its share of the batch under the
whole batch's normalisation, the gradients are summed across ranks, and every
rank takes the same optimizer step. Identical start state plus identical
summed gradients keep the replicas' weights identical after every step.

The group is a private torch.distributed process group (gloo on CPU, NCCL on
GPU) on its own TCPStore, like the weight-sync group, so it can be torn down
and rebuilt whenever the membership changes (each build under a new rendezvous
key the leader draws and hands out with the port, weightsync.make_group): a replica joins by receiving the
leader's parameters and optimizer state, a replica leaves by dropping out of
the next group (its state stays in its process's memory).

Commands travel as a small JSON header and, for a batch, the trajectories'
protobuf encoding: data, never code.
"""

from __future__ import annotations

import json
import logging
import threading
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from reflow.core.errors import TemporaryError
from reflow.core.types import Trajectory
from reflow.trainer.handoff import Descriptor, SharedState, copy_from_leader, state_tensors
from reflow.weightsync import SyncGroup, make_group
from reflow.wire import trajectory_from_bytes, trajectory_to_bytes

logger = logging.getLogger(__name__)

# Flattened all-reduce buckets (bytes): large enough to amortise a collective's
# latency, small enough not to double a big model's gradient memory.
ALLREDUCE_BUCKET_BYTES = 32 * 1024 * 1024
# Parameters and optimizer state travel to a joining replica in buckets this size.
STATE_BUCKET_BYTES = 256 * 1024 * 1024
# A command header larger than this is a protocol error, not a batch.
MAX_HEADER_BYTES = 1 << 20


def shard_indices(lengths: list[int], rank: int, world_size: int) -> list[int]:
    """The batch positions rank `rank` computes: longest first, dealt in turn, so
    every rank gets about the same number of tokens. Every rank computes the
    same plan from the same batch, without talking."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside a group of {world_size}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return sorted(order[rank::world_size])


def _buckets(tensors: list[torch.Tensor], bucket_bytes: int) -> list[list[torch.Tensor]]:
    """Consecutive tensors of one dtype, at most `bucket_bytes` a bucket (a larger
    tensor alone); every rank cuts the same list the same way."""
    buckets: list[list[torch.Tensor]] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or buckets[-1][0].dtype != t.dtype or size + nbytes > bucket_bytes:
            buckets.append([])
            size = 0
        buckets[-1].append(t)
        size += nbytes
    return buckets


class GroupBroken(TemporaryError):
    """A collective of the trainer group failed: a peer died (its sockets closed),
    aborted the group, timed out, or was found gone while this rank waited for it
    (`TrainerGroup.abandon`). Raised before any rank's optimizer step of
    the batch (the gradient all-reduce is the step's last collective), so the
    leader can rebuild the group from the ranks still there and train the same
    batch again (TrainLoop._group_broken)."""


@dataclass
class TrainerGroup:
    """One membership of the trainer group: this process's rank in it."""

    sync: SyncGroup
    rank: int
    world_size: int
    epoch: int
    device: torch.device
    # Set when a member is known gone (TrainLoop.reconfigure found it unreachable):
    # a collective waiting for it ends now, not after the group's timeout.
    abandoned: threading.Event = field(default_factory=threading.Event)
    abandon_reason: str = ""

    @classmethod
    def build(cls, master_address: str, master_port: int, rank: int, world_size: int,
              epoch: int, device: torch.device, timeout_s: float, *,
              rendezvous_key: str) -> TrainerGroup:
        """`rendezvous_key`: the group's secret (weightsync.new_rendezvous_key), drawn
        by the leader and handed to the replicas with the port."""
        backend = "nccl" if device.type == "cuda" else "gloo"
        sync = make_group(master_address, master_port, rank, world_size, backend, timeout_s,
                          rendezvous_key=rendezvous_key)
        return cls(sync, rank, world_size, epoch, device)

    # --- collectives ------------------------------------------------------------------

    def _collective(self, what: str, start) -> None:
        """Run one collective (`start(group)` returns its work) and wait for it; any
        failure is the group's (GroupBroken), whatever the backend calls it."""
        group = self.sync.group
        if group is None:
            raise GroupBroken(f"trainer group epoch {self.epoch} was aborted")
        try:
            work = start(group)
            # Not held by this frame (which a GroupBroken's traceback keeps) while
            # waiting: whoever drops the group last runs gloo's blocking destructor.
            del group
            self._await(work, what)
        except GroupBroken:  # abandoned: says so itself
            raise
        except RuntimeError as err:  # gloo's and NCCL's errors, timeouts included
            raise GroupBroken(f"trainer group epoch {self.epoch}: {what} failed: "
                              f"{type(err).__name__}: {err}"[:1000]) from err

    def _await(self, work, what: str) -> None:
        """The work's end, or the group's abandonment. A peer that died does not
        always fail the collective waiting for it: gloo noticed the closed socket of
        a killed replica only at the group's timeout (measured, the leader inside a
        broadcast), and a frozen host closes none. So the wait polls, from 0.1 ms
        (a collective on one host is over in about that) up to 20 ms."""
        delay = 1e-4
        while not work.is_completed():
            if self.abandoned.wait(delay):
                raise GroupBroken(f"trainer group epoch {self.epoch}: {what} abandoned: "
                                  f"{self.abandon_reason}"[:1000])
            delay = min(2 * delay, 0.02)
        work.wait()

    def point_to_point(self, sends: list[tuple[torch.Tensor, int, int]],
                       recvs: list[tuple[torch.Tensor, int, int]]) -> None:
        """Post every send (tensor, destination rank, tag) and every receive (tensor,
        source rank, tag) at once, then wait for all: no order between the peers
        to deadlock on. Each tensor is contiguous; a receive lands in it."""
        group = self.sync.group
        if group is None:
            raise GroupBroken(f"trainer group epoch {self.epoch} was aborted")
        try:
            works = [group.send([t], dst, tag) for t, dst, tag in sends]
            works += [group.recv([t], src, tag) for t, src, tag in recvs]
            del group
            # gloo's send and receive works report completion only from wait()
            # (is_completed stays False: measured, torch 2.13), so they cannot be
            # polled like a collective: a transfer with a dead peer ends at the
            # group's timeout at the latest, an abandonment between two of them.
            for work in works:
                if self.abandoned.is_set():
                    raise GroupBroken(f"trainer group epoch {self.epoch}: shard transfer "
                                      f"abandoned: {self.abandon_reason}"[:1000])
                work.wait()
        except RuntimeError as err:
            raise GroupBroken(f"trainer group epoch {self.epoch}: shard transfer failed: "
                              f"{type(err).__name__}: {err}"[:1000]) from err

    def abandon(self, reason: str) -> None:
        """A member is gone: the collective this rank waits in, and every later one,
        raises GroupBroken. Called from any thread."""
        self.abandon_reason = reason
        self.abandoned.set()

    def _broadcast(self, tensor: torch.Tensor) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank = 0
        self._collective("broadcast", lambda g: g.broadcast([tensor], opts))

    def _all_reduce(self, tensor: torch.Tensor, op=dist.ReduceOp.SUM) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        self._collective("all-reduce", lambda g: g.allreduce([tensor], opts))

    def abort(self) -> None:
        """Close the group now (weightsync.SyncGroup.abort): every peer still in one
        of its collectives fails at once instead of after the group's timeout. An
        abandoned group is closed on a thread of its own: gloo's destructor waits
        for the collective still waiting on the gone member, which ends only at the
        group's timeout."""
        if self.abandoned.is_set():
            threading.Thread(target=self.close, daemon=True,
                             name=f"abandoned-group-{self.epoch}").start()
        else:
            self.close()

    def close(self) -> None:
        """Release the group's process group (and with it its connections)."""
        self.sync.abort()

    def _broadcast_bytes(self, data: bytes | None) -> bytes:
        # On the group's device: NCCL moves CUDA tensors only.
        size = torch.tensor([len(data) if data is not None else 0], dtype=torch.int64,
                            device=self.device)
        self._broadcast(size)
        buf = (torch.frombuffer(bytearray(data), dtype=torch.uint8).to(self.device) if data
               else torch.empty(int(size.item()), dtype=torch.uint8, device=self.device))
        if buf.numel():
            self._broadcast(buf)
        return buf.cpu().numpy().tobytes()

    # --- commands ---------------------------------------------------------------------

    def send_command(self, op: str, step: int = 0,
                     trajectories: list[Trajectory] | None = None, arg: str = "") -> None:
        """Leader: tell every replica what to do next (`train` a batch, `regroup`
        for a new membership, `stop` at the end of the job; with fsdp also
        `publish`, `checkpoint` and `resume` a checkpoint directory `arg`, and
        `export`, each a collective every rank joins)."""
        blobs = [trajectory_to_bytes(t) for t in trajectories or []]
        header = json.dumps({"op": op, "step": step, "sizes": [len(b) for b in blobs],
                             "arg": arg})
        self._broadcast_bytes(header.encode())
        if blobs:
            self._broadcast_bytes(b"".join(blobs))

    def receive_command(self) -> tuple[str, int, list[Trajectory], str]:
        """Replica: the leader's next command: (op, step, trajectories, arg)."""
        raw = self._broadcast_bytes(None)
        if len(raw) > MAX_HEADER_BYTES:
            raise ValueError(f"trainer group: a {len(raw)}-byte command header")
        header = json.loads(raw)
        sizes = [int(n) for n in header.get("sizes", [])]
        trajectories: list[Trajectory] = []
        if sizes:
            payload, offset = self._broadcast_bytes(None), 0
            for n in sizes:
                trajectories.append(trajectory_from_bytes(payload[offset:offset + n]))
                offset += n
        return (str(header["op"]), int(header.get("step", 0)), trajectories,
                str(header.get("arg", "")))

    def transfer_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       shared: SharedState | None = None) -> str:
        """Every rank: bring the replicas to rank 0's parameters and optimizer state.
        Rank 0 offers its same-host shared state (`shared`, handoff.py); when every
        replica could copy from it, that is all, otherwise the state is broadcast.
        Returns how: `shared_memory` or `broadcast`."""
        offer = shared.descriptor().encode() if self.rank == 0 and shared else b""
        raw = self._broadcast_bytes(offer if self.rank == 0 else None)
        copied = bool(raw)
        if self.rank and raw:
            try:
                copy_from_leader(Descriptor.decode(raw), state_tensors(model, optimizer))
            except (OSError, ValueError) as err:
                logger.info("trainer group: no same-host state hand-off (%s); broadcasting", err)
                copied = False
        everyone = torch.tensor([1 if copied else 0], dtype=torch.int64, device=self.device)
        self._all_reduce(everyone, dist.ReduceOp.MIN)
        if int(everyone.item()) == 1:
            return "shared_memory"
        self.broadcast_state(model, optimizer)
        return "broadcast"

    def broadcast_state(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> int:
        """Rank 0's parameters and optimizer state to every rank, in flat buckets
        (one collective per bucket, not per tensor); returns bytes."""
        sent = 0
        with torch.no_grad():
            for bucket in _buckets(state_tensors(model, optimizer), STATE_BUCKET_BYTES):
                numel = sum(t.numel() for t in bucket)
                if self.rank == 0:
                    flat = torch.cat([t.reshape(-1) for t in bucket]).to(self.device)
                else:
                    flat = torch.empty(numel, dtype=bucket[0].dtype, device=self.device)
                self._broadcast(flat)
                if self.rank:
                    offset = 0
                    for t in bucket:
                        t.copy_(flat[offset:offset + t.numel()].view_as(t))
                        offset += t.numel()
                sent += flat.numel() * flat.element_size()
        return sent

    def sum_gradients(self, model: torch.nn.Module, extra: torch.Tensor) -> torch.Tensor:
        """Sum every parameter's gradient and `extra` (per-rank statistics) across
        the group, in flat buckets; returns the summed `extra`."""
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:  # a parameter this shard did not reach
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params:
            bucket.append(p.grad)
            size += p.grad.numel() * p.grad.element_size()
            if size >= ALLREDUCE_BUCKET_BYTES:
                self._reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            self._reduce_bucket(bucket)
        extra = extra.to(self.device)
        self._all_reduce(extra)
        return extra

    def _reduce_bucket(self, grads: list[torch.Tensor]) -> None:
        by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
        for g in grads:
            by_dtype.setdefault(g.dtype, []).append(g)
        for same in by_dtype.values():
            flat = torch.cat([g.reshape(-1) for g in same])
            self._all_reduce(flat)
            offset = 0
            for g in same:
                g.copy_(flat[offset:offset + g.numel()].view_as(g))
                offset += g.numel()

