"""An FSDP trainer group that changes membership by moving shards (paper §5.2:
a worker flipping to trainer receives "parameter and optimizer shards from an
existing trainer replica by shard-local broadcast").

FSDP2 shards every parameter, and with it AdamW's two moments, on dim 0 the way
`torch.chunk` cuts it: ceil(rows / N) rows a rank, the last ranks fewer or
none. A membership of N ranks becomes one of M by moving, for every tensor,
the rows where an old rank's chunk and a new rank's chunk overlap
(`plan_moves`): point to point, from the old owner to the new, over a group of
every process in either membership (the union). A joiner receives its own 1/M
of the state and nothing more; a leaver sends its 1/N before it goes; no
process ever holds a tensor's rows it does not own, so none materialises the
whole optimizer state. A rank whose chunk stays (or partly stays) copies it
in place.

Every member of the new membership builds its FSDP model anew from the model's
config on the meta device (`rebuild_policy`), sharded over the new group, and
the moved rows land in its local shards directly. The first membership
(`ReshardPlan.initial`) moves nothing: every rank shards the weights it loaded
from model.path, as fsdp.shard_policy always did.

The plan travels from the leader as JSON over the union group and is checked
before anything moves: ranks a permutation, the leader rank 0 of both, the
tensors' layout (names, global shapes, dtypes) the receiver's own.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import asdict, dataclass, field

import torch

from reflow.trainer.dp import TrainerGroup
from reflow.trainer.fsdp import ShardedGroup, policy_parameters, shard_policy
from reflow.trainer.handoff import materialise_optimizer_state
from reflow.weightsync import check_rendezvous_key

logger = logging.getLogger(__name__)

MAX_PLAN_BYTES = 1 << 20
MAX_UNION = 4096
# Point-to-point transfers in flight at once: gloo keeps one buffer per message.
MAX_INFLIGHT = 256
# The optimizer-state tensors that are sharded like their parameter (AdamW's).
MOMENTS = ("exp_avg", "exp_avg_sq")


def chunk_rows(length: int, world: int, rank: int) -> tuple[int, int]:
    """Rows [start, stop) of a dim-0 length that FSDP2's Shard(0) gives `rank` of
    `world`: torch.chunk's cut, ceil(length / world) rows a rank."""
    per = -(-length // world)
    start = min(rank * per, length)
    return start, min(start + per, length)


@dataclass(frozen=True)
class Move:
    """Rows of tensor `tensor` from union rank `src`'s old shard to union rank
    `dst`'s new shard, each as local row ranges."""

    tensor: int
    src: int
    dst: int
    src_rows: tuple[int, int]
    dst_rows: tuple[int, int]


def plan_moves(lengths: list[int], old_ranks: list[int], new_ranks: list[int],
               old_shards: int = 0, new_shards: int = 0) -> list[Move]:
    """Every overlap of an old and a new chunk of each tensor (dim-0 `lengths`),
    for union members with ranks `old_ranks` / `new_ranks` (-1: not a member).
    `old_shards`/`new_shards`: the ranks a replica shards over (trainer.parallelism
    hsdp; rank r holds chunk r % shards, as every other replica's rank of that
    shard does); 0 shards over the whole membership. A chunk held by several old
    ranks comes from the new owner itself where it holds it (copied in place),
    else from the first holder in union order."""
    old_world = sum(r >= 0 for r in old_ranks)
    new_world = sum(r >= 0 for r in new_ranks)
    s_old, s_new = old_shards or old_world, new_shards or new_world
    holders: dict[int, list[int]] = {}
    for src, o in enumerate(old_ranks):
        if o >= 0:
            holders.setdefault(o % s_old, []).append(src)
    moves = []
    for t, length in enumerate(lengths):
        for dst, n in enumerate(new_ranks):
            if n < 0:
                continue
            n0, n1 = chunk_rows(length, s_new, n % s_new)
            for j in range(s_old):
                o0, o1 = chunk_rows(length, s_old, j)
                a, b = max(o0, n0), min(o1, n1)
                if a >= b:
                    continue
                if j not in holders:
                    raise ValueError(f"reshard plan: shard {j} of {s_old} is held by no "
                                     "member (a whole shard's holders were lost)")
                src = dst if dst in holders[j] else holders[j][0]
                moves.append(Move(t, src, dst, (a - o0, b - o0), (a - n0, b - n0)))
    return moves


@dataclass(frozen=True)
class ReshardPlan:
    """One membership change of an FSDP group, as the leader sends it: per union
    rank its rank in the old group and in the new one (-1 where it is not a
    member), the new group's port, rendezvous key and epoch, AdamW's step count
    per parameter, and the digest of the state's layout every member must share."""

    epoch: int
    port: int
    old_ranks: list[int]
    new_ranks: list[int]
    steps: list[float]
    layout: str
    initial: bool = False
    # The new group's secret (weightsync.make_group), drawn by the leader; the plan
    # travels over the union group, itself keyed.
    rendezvous_key: str = field(default="", repr=False)
    # trainer.parallelism hsdp: the ranks of a replica, before and after (0: fsdp,
    # sharded over the whole membership). A broken group's survivors keep the old
    # ranks they had, which then need not be 0..N-1.
    old_shards: int = 0
    new_shards: int = 0

    @property
    def old_world(self) -> int:
        return sum(r >= 0 for r in self.old_ranks)

    @property
    def new_world(self) -> int:
        return sum(r >= 0 for r in self.new_ranks)

    def encode(self) -> bytes:
        return json.dumps(asdict(self)).encode()

    @classmethod
    def decode(cls, raw: bytes) -> ReshardPlan:
        """The leader's plan, validated; ValueError naming what is wrong."""
        if not raw or len(raw) > MAX_PLAN_BYTES:
            raise ValueError(f"reshard plan: {len(raw)} bytes")
        try:
            data = json.loads(raw)
        except ValueError as err:
            raise ValueError(f"reshard plan: not JSON ({err})") from None
        if not isinstance(data, dict) or set(data) != set(cls.__dataclass_fields__):
            raise ValueError("reshard plan: unexpected fields")
        plan = cls(**data)
        for name in ("old_shards", "new_shards"):
            value = getattr(plan, name)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_UNION:
                raise ValueError(f"reshard plan: {name} {value!r}")
        for name in ("old_ranks", "new_ranks"):
            ranks = getattr(plan, name)
            if (not isinstance(ranks, list) or len(ranks) > MAX_UNION
                    or not all(isinstance(r, int) and not isinstance(r, bool) for r in ranks)):
                raise ValueError(f"reshard plan: {name} must be a list of integers")
            members = sorted(r for r in ranks if r >= 0)
            survivors = name == "old_ranks" and plan.old_shards
            if (len(set(members)) != len(members) or (members and members[-1] >= MAX_UNION)
                    if survivors else members != list(range(len(members)))):
                raise ValueError(f"reshard plan: {name} {ranks} is not a permutation of 0..N-1")
        if plan.new_shards and plan.new_world % plan.new_shards:
            raise ValueError(f"reshard plan: {plan.new_world} ranks are not whole replicas of "
                             f"{plan.new_shards}")
        if len(plan.old_ranks) != len(plan.new_ranks) or not plan.new_ranks:
            raise ValueError("reshard plan: old_ranks and new_ranks differ in length")
        if plan.new_ranks[0] != 0 or plan.old_ranks[0] != (-1 if plan.initial else 0):
            raise ValueError("reshard plan: the leader is rank 0 of both memberships")
        if plan.initial != (plan.old_world == 0):
            raise ValueError("reshard plan: only the first membership has no old ranks")
        if not (isinstance(plan.port, int) and 1 <= plan.port <= 65535):
            raise ValueError(f"reshard plan: port {plan.port!r}")
        try:
            check_rendezvous_key(plan.rendezvous_key)
        except ValueError as err:
            raise ValueError(f"reshard plan: {err}") from None
        if not (isinstance(plan.steps, list)
                and all(isinstance(s, (int, float)) and s >= 0 for s in plan.steps)):
            raise ValueError("reshard plan: steps must be non-negative numbers")
        if not isinstance(plan.epoch, int) or not isinstance(plan.layout, str):
            raise ValueError("reshard plan: epoch and layout")
        return plan


def layout_of(model: torch.nn.Module) -> tuple[list[str], list[torch.Size], str]:
    """Names and global shapes of the parameters (fsdp.policy_parameters' order,
    a tied weight once) and a digest of them with their dtypes."""
    named = policy_parameters(model)
    names = [n for n, _ in named]
    shapes = [p.shape for _, p in named]
    text = ";".join(f"{n}:{p.dtype}:{tuple(p.shape)}" for n, p in named)
    return names, shapes, hashlib.sha256(text.encode()).hexdigest()


def local_state(root, optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards in the agreed order: every parameter's, then its two
    AdamW moments (created as zeros where no step has made them yet)."""
    from torch.distributed.tensor import DTensor

    materialise_optimizer_state(optimizer)
    params = [p for _, p in policy_parameters(root)]
    tensors = list(params)
    for p in params:
        tensors.extend(optimizer.state[p][k] for k in MOMENTS)
    return [t.to_local() if isinstance(t, DTensor) else t for t in tensors]


def optimizer_steps(root, optimizer: torch.optim.Optimizer) -> list[float]:
    materialise_optimizer_state(optimizer)
    return [float(optimizer.state[p]["step"]) for _, p in policy_parameters(root)]


def state_bytes(model: torch.nn.Module, moments: int = len(MOMENTS)) -> int:
    """Bytes of the whole parameters and their AdamW moments, unsharded."""
    return sum(p.numel() * p.element_size() for _, p in policy_parameters(model)) * (1 + moments)


def moved_bytes(plan: ReshardPlan, shapes: list[torch.Size], element_size: int) -> dict[int, int]:
    """Bytes each union rank receives from another process under `plan` (its
    own rows copied in place count nothing)."""
    lengths, row_bytes = _tensor_rows(shapes, element_size)
    received: dict[int, int] = {}
    for m in plan_moves(lengths, plan.old_ranks, plan.new_ranks, plan.old_shards,
                        plan.new_shards):
        if m.src != m.dst:
            n = (m.dst_rows[1] - m.dst_rows[0]) * row_bytes[m.tensor]
            received[m.dst] = received.get(m.dst, 0) + n
    return received


def describe_moves(plan: ReshardPlan, root, joiners: list[int]) -> str:
    """The flip event's account of a membership change (`last_handoff`): bytes
    the joiners (union ranks) received, bytes that moved between the other
    processes, and the whole state's unsharded bytes. elastic.py parses it."""
    _, shapes, _ = layout_of(root)
    element_size = next(p for _, p in policy_parameters(root)).element_size()
    received = moved_bytes(plan, shapes, element_size)
    to_joiners = sum(received.get(u, 0) for u in joiners)
    between = sum(received.values()) - to_joiners
    full = state_bytes(root)
    return f"shards {to_joiners} B to joiners, {between} B between members, of {full} B"


def _tensor_rows(shapes: list[torch.Size], element_size: int) -> tuple[list[int], list[int]]:
    """Dim-0 lengths and bytes per row of the agreed tensor list (parameters,
    then each parameter's moments)."""
    def row(shape):
        n = 1
        for d in shape[1:]:
            n *= d
        return n * element_size

    lengths = [s[0] for s in shapes] + [s[0] for s in shapes for _ in MOMENTS]
    rows = [row(s) for s in shapes] + [row(s) for s in shapes for _ in MOMENTS]
    return lengths, rows


def move_shards(union: TrainerGroup, plan: ReshardPlan, me: int, shapes: list[torch.Size],
                old: list[torch.Tensor] | None, new: list[torch.Tensor] | None) -> int:
    """This process's part of the moves: send its old rows, receive its new rows,
    copy the rows it keeps. Returns the bytes it received from others."""
    lengths = [s[0] for s in shapes] + [s[0] for s in shapes for _ in MOMENTS]
    received = 0
    sends, recvs = [], []
    # Batches are cut at the same moves on every process (every MAX_INFLIGHT of
    # the plan's, not of this process's), so a batch's every receive has its send
    # posted in the same batch on the other side.
    for i, m in enumerate(plan_moves(lengths, plan.old_ranks, plan.new_ranks, plan.old_shards,
                                     plan.new_shards), start=1):
        if m.src == me and m.dst == me:
            new[m.tensor][m.dst_rows[0]:m.dst_rows[1]].copy_(
                old[m.tensor][m.src_rows[0]:m.src_rows[1]])
        elif m.src == me:
            sends.append((old[m.tensor][m.src_rows[0]:m.src_rows[1]], m.dst, m.tensor))
        elif m.dst == me:
            view = new[m.tensor][m.dst_rows[0]:m.dst_rows[1]]
            recvs.append((view, m.src, m.tensor))
            received += view.numel() * view.element_size()
        if i % MAX_INFLIGHT == 0:
            union.point_to_point(sends, recvs)
            sends, recvs = [], []
    union.point_to_point(sends, recvs)
    return received


def rebuild_policy(previous: torch.nn.Module, spec, mesh, device: torch.device):
    """A new FSDP root for a new membership: the model built from its config on the
    meta device, sharded over `mesh`, given storage for its local shards only;
    buffers (rotary frequencies) and tensor attributes copied from `previous`, a
    model of the same config this process already holds. The parameters'
    values are whatever the memory held: move_shards fills them."""
    from transformers import AutoModelForCausalLM

    config = previous.config
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=getattr(torch,
                                                                        spec.model.dtype))
    if spec.trainer.activation_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    root = shard_policy(model, mesh, device, spec.trainer.fsdp_cpu_offload)
    root.to_empty(device=device if not spec.trainer.fsdp_cpu_offload else "cpu")
    _copy_unsharded(previous, model, device)
    return model, root


def _copy_unsharded(previous: torch.nn.Module, model: torch.nn.Module,
                    device: torch.device) -> None:
    """Buffers, and tensors modules keep as plain attributes (a rotary embedding's
    original frequencies), from `previous`: not parameters, so not sharded and
    not moved, and built on meta without values."""
    old_modules = dict(previous.named_modules())
    with torch.no_grad():
        for name, module in model.named_modules():
            source = old_modules.get(name)
            if source is None:
                continue
            for key, buf in module.named_buffers(recurse=False):
                buf.copy_(source.get_buffer(key))
            for key, value in list(vars(module).items()):
                if isinstance(value, torch.Tensor) and value.is_meta:
                    setattr(module, key, getattr(source, key).detach().to(device).clone())


def apply_plan(loop, plan: ReshardPlan, me: int, union: TrainerGroup, host: str):
    """This process's part of a membership change (`loop` a TrainLoop, the leader's
    or a replica's): its old shards out, its new shards in, over `union`. A member
    of the new membership returns its new ShardedGroup with loop.root,
    loop.model and loop.optimizer the new ones; a leaver returns None with
    them dropped (its loaded weights stay, for the buffers of a later join).
    Returns (group, bytes received)."""
    new_rank = plan.new_ranks[me]
    old_root, old_optimizer = loop.root, loop.optimizer
    # Checked before anything closes or moves: the leader's tensors are this rank's.
    names, shapes, digest = layout_of(old_root if old_root is not None else loop.model)
    if digest != plan.layout:
        raise ValueError("reshard plan: the leader's model layout is not this rank's model")
    old = None
    if plan.old_ranks[me] >= 0:
        if old_root is None:
            raise ValueError("reshard plan: an old rank for a process that holds no shards")
        old = local_state(old_root, old_optimizer)
        if loop.group is not None:  # a broken group's survivor has none left
            loop.group.close()  # the old default group: the new one takes its place
        loop.group = None
    if new_rank < 0:
        received = move_shards(union, plan, me, shapes, old, None) if not plan.initial else 0
        loop.root = None
        loop.optimizer = None
        return None, received
    group = ShardedGroup.build(host, plan.port, new_rank, plan.new_world, loop.device,
                               loop.group_timeout_s, plan.epoch,
                               rendezvous_key=plan.rendezvous_key, shards=plan.new_shards,
                               collective_timeout_s=loop.spec.trainer.collective_timeout_s)
    try:
        if plan.initial:
            # The first membership: the weights every rank loaded, sharded in place.
            root = shard_policy(loop.model, group.mesh, loop.device,
                                loop.spec.trainer.fsdp_cpu_offload)
            model = loop.model
        else:
            model, root = rebuild_policy(loop.model, loop.spec, group.mesh, loop.device)
        optimizer = loop._new_optimizer(root.parameters())
        received = 0
        if not plan.initial:
            with torch.no_grad():
                received = move_shards(union, plan, me, shapes, old,
                                       local_state(root, optimizer))
            for (_, p), step in zip(policy_parameters(root), plan.steps, strict=True):
                optimizer.state[p]["step"] = torch.tensor(step)
    except BaseException:
        group.close()  # this process's default group: a later join builds its own
        raise
    del old
    loop.model, loop.root, loop.optimizer, loop.group = model, root, optimizer, group
    return group, received
