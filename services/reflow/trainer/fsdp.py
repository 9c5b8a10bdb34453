"""The trainer group with sharded state: FSDP2 (`fully_shard`) over the group's
ranks, so each rank holds 1/N of the parameters, their gradients and AdamW's
moments instead of all of them (paper §5: the trainer is FSDP). With
trainer.parallelism hsdp the group is replicas of trainer.shard_size ranks: each
replica shards the model over its ranks and the replicas hold the same shards
(HSDP, a 2-D device mesh), so a lost replica loses nothing the others lack.

Each transformer block is its own FSDP unit and the root unit is a
`PolicyScorer` around the Hugging Face model: the module whose forward is the
trainer's whole scoring pass (step.sequence_logprobs), so the root's hooks
gather the embedding, the final norm and the output head (tied or not) for the
chunked log-probability path, which calls the base model and the head
separately. Gradients are reduce-scattered summed, not averaged: the loss is
already normalised by the whole batch's tokens on every rank (step.py), as the
replicated group's summed all-reduce is.

The group is this process's default torch.distributed group (FSDP2's
DeviceMesh needs one), on its own TCPStore under the rendezvous key the leader
drew (sent with the port in the reshard plan, weightsync.make_group); a process
holds at most one.
Parameter FQNs are the Hugging Face model's own, so a sharded checkpoint and a
replicated one name the same tensors and DCP re-shards either into any world
size (trainer/checkpoint.py's format). A membership change moves each rank's
rows to their new owners (trainer/reshard.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from reflow.trainer.dp import TrainerGroup
from reflow.weightsync import SyncGroup, check_rendezvous_key, key_redacted, keyed_store

logger = logging.getLogger(__name__)

_STORE_PREFIX = "reflow-fsdp"
# trainer.parallelism: auto shards models of this many parameters or more: there a
# replicated rank's fp32 weights, gradients and AdamW moments pass 16 GB.
FSDP_AUTO_MIN_PARAMETERS = 1_000_000_000


def wants_fsdp(spec, parameters: int) -> bool:
    """trainer.parallelism resolved for a model of `parameters`: `auto` is fsdp
    for an elastic pool whose group has 2 or more ranks at start or may grow by
    role flips, on a large model (FSDP_AUTO_MIN_PARAMETERS). Every rank resolves
    it alike."""
    choice = spec.trainer.parallelism
    if choice != "auto":
        return choice in ("fsdp", "hsdp")
    return (spec.cluster.workers is not None
            and (spec.cluster.trainer_workers >= 2 or spec.flips_roles)
            and parameters >= FSDP_AUTO_MIN_PARAMETERS)


class PolicyScorer(torch.nn.Module):
    """The FSDP root: token log-probabilities of a batch under the policy in one
    forward (step.sequence_logprobs), so every parameter the pass touches is
    gathered by an FSDP hook first. Holds the model as `module` but reports
    its parameters under the model's own names (`policy_state_dict`)."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.module = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                temperature: float = 1.0, chunk_tokens: int | None = None,
                with_entropy: bool = False, suppress: torch.Tensor | None = None,
                stop_ids: torch.Tensor | None = None):
        from reflow.trainer.step import sequence_logprobs

        # A copy, not the view the chunked path returns: FSDP's pre-backward hook
        # sits on the output, and an in-place op on a view would lose it.
        out = sequence_logprobs(self.module, input_ids, attention_mask, temperature,
                                chunk_tokens, with_entropy, suppress, stop_ids)
        return (out[0].clone(), out[1]) if with_entropy else out.clone()


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks of a Hugging Face causal LM (`model.layers` of its
    base model), each an FSDP unit."""
    base = getattr(model, "base_model", model)
    layers = getattr(base, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: no `layers` in its base model; sharding "
                         "needs the transformer blocks as a ModuleList")
    return list(layers)


def mixed_precision_for(device: torch.device):
    """bf16 compute with fp32 gradient reduction where the device has bf16 matmuls
    (a CUDA GPU of compute capability 8 or more); full fp32 elsewhere, so a CPU
    group computes what the replicated trainer computes."""
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    return MixedPrecisionPolicy()


def shard_policy(model: torch.nn.Module, mesh, device: torch.device,
                 cpu_offload: bool = False) -> PolicyScorer:
    """`fully_shard` each block, then the root around the model; returns the root.
    Every rank must call this with the same model (same weights: the same
    checkpoint or seed), since each keeps its own slice of what it holds."""
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    options = dict(mesh=mesh, mp_policy=mixed_precision_for(device),
                   offload_policy=CPUOffloadPolicy() if cpu_offload else OffloadPolicy())
    for layer in decoder_layers(model):
        fully_shard(layer, **options)
    root = PolicyScorer(model)
    fully_shard(root, **options)
    # Sum, not mean: each rank's loss is its share of the whole batch's (step.py).
    # A divide factor of 1 with sum-only collectives is a plain SUM reduce-scatter
    # (gloo has no PREMUL_SUM, FSDP's op for a custom factor).
    for unit in [*decoder_layers(model), root]:
        unit.set_gradient_divide_factor(1.0)
        unit.set_force_sum_reduction_for_comms(True)
    return root


@dataclass
class ShardedGroup(TrainerGroup):
    """One membership of an FSDP trainer group: this process's default process
    group and its one-dimensional device mesh. The leader's commands travel over
    the same group (TrainerGroup's protocol). `sharded` tells step.compute_step
    that FSDP reduces the gradients and that every rank must run as many
    forward/backward passes as the others."""

    mesh: object = None
    sharded: bool = True

    @classmethod
    def build(cls, master_address: str, master_port: int, rank: int, world_size: int,
              device: torch.device, timeout_s: float = 600.0, epoch: int = 1, *,
              rendezvous_key: str, shards: int = 0,
              collective_timeout_s: float | None = None) -> ShardedGroup:
        """`rendezvous_key`: the group's secret, as TrainerGroup.build's. `shards`:
        the ranks each replica shards over (trainer.parallelism hsdp): a 2-D mesh of
        world_size / shards replicas by `shards`, rank r being shard r % shards of
        replica r // shards; 0 (or world_size) shards over the whole group.
        `collective_timeout_s`: with gloo, the 2-D mesh's groups time out after it,
        not after `timeout_s` (trainer.collective_timeout_s)."""
        if shards and world_size % shards:
            raise ValueError(f"trainer group: {world_size} ranks are not whole replicas of "
                             f"{shards} (trainer.shard_size)")
        check_rendezvous_key(rendezvous_key)
        if dist.is_initialized():
            raise RuntimeError("this process already holds a trainer group; close it first")
        from torch.distributed.device_mesh import init_device_mesh

        timeout = timedelta(seconds=timeout_s)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0,
                              timeout=timeout)
        backend = "nccl" if device.type == "cuda" else "gloo"
        with key_redacted(rendezvous_key):
            dist.init_process_group(backend, store=keyed_store(store, rendezvous_key,
                                                               _STORE_PREFIX),
                                    rank=rank, world_size=world_size, timeout=timeout)
        if shards and shards != world_size:
            # FSDP2 over a 2-D mesh is HSDP: sharded along "shard", replicated (its
            # gradients all-reduced) along "replicate".
            mesh = init_device_mesh(device.type, (world_size // shards, shards),
                                    mesh_dim_names=("replicate", "shard"),
                                    backend_override=_mesh_timeouts(backend,
                                                                    collective_timeout_s))
        else:
            mesh = init_device_mesh(device.type, (world_size,))
        return cls(SyncGroup(dist.group.WORLD, store), rank, world_size, epoch, device,
                   mesh=mesh)

    # On the whole group, polled as TrainerGroup's own collectives are: a rank the
    # leader tells to leave (TrainerReplica.leave) is not held here.
    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.to(self.device)
        self._all_reduce(out)
        return out

    def max_int(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64, device=self.device)
        self._all_reduce(t, dist.ReduceOp.MAX)
        return int(t.item())

    def close(self) -> None:
        """Destroy this process's default group (TrainerGroup.abort calls it, off
        the caller's thread for an abandoned group)."""
        self.sync.group = None
        if dist.is_initialized():
            dist.destroy_process_group()


def _mesh_timeouts(backend: str, timeout_s: float | None) -> dict | None:
    """The 2-D mesh's groups with their own, shorter timeout (gloo). Why: a replica
    that lost its partner gives the step up and leaves its collectives, but its
    process lives on, and gloo closes a group's connections only once nothing holds
    the group (FSDP's modules and the device mesh do, measured with torch 2.13: not
    even destroy_process_group closes them). A survivor still waiting in a
    collective with that rank is freed only by the timeout. NCCL aborts the whole
    process at its watchdog's timeout, so it keeps the group's."""
    if backend != "gloo" or timeout_s is None:
        return None
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    return {"replicate": ("gloo", options), "shard": ("gloo", options)}


# What a collective that failed because a rank is gone says (gloo's transport, NCCL).
_PEER_GONE = ("gloo/transport", "Connection reset by peer", "Connection closed by peer",
              "NCCL communicator was aborted", "NCCL error")


def collective_failed(err: BaseException) -> bool:
    """Whether `err`, raised inside an FSDP step, is a failed collective of the
    group (a rank died), not a fault of the step itself."""
    return isinstance(err, dist.DistError) or any(m in str(err) for m in _PEER_GONE)


def reshard_units(root: torch.nn.Module) -> None:
    """Every FSDP unit back to its sharded parameters (freeing what a step cut short
    left gathered): what the module then holds is this rank's shards, untouched by
    the optimizer, ready to move into the group formed next (trainer/reshard.py).
    Local: no collective."""
    from torch.distributed.fsdp import FSDPModule

    for module in root.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def policy_parameters(root: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(name, parameter) of what a weight sync sends, of a PolicyScorer or of the
    model itself: every parameter under the Hugging Face model's names, a tied
    weight once, or with LoRA the adapters under PEFT's (lora.synced_parameters)."""
    from reflow.trainer.lora import synced_parameters

    return synced_parameters(root.module if isinstance(root, PolicyScorer) else root)


def gathered_buckets(root: PolicyScorer, bucket_bytes: int
                     ) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """The whole parameters, gathered from the shards a bucket at a time
    (`full_tensor()` per parameter; a parameter larger than a bucket alone):
    never more than one bucket of gathered weights exists at once, beyond this
    rank's own shard. Every rank must iterate to the end (each gather is a
    collective); the caller drops a bucket before asking for the next."""
    from torch.distributed.tensor import DTensor

    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    with torch.no_grad():
        for name, p in policy_parameters(root):
            full = p.full_tensor() if isinstance(p, DTensor) else p.detach()
            nbytes = full.numel() * full.element_size()
            if bucket and size + nbytes > bucket_bytes:
                yield bucket
                bucket, size = [], 0
            bucket.append((name, full))
            size += nbytes
        if bucket:
            yield bucket


def policy_state(root: PolicyScorer, optimizer: torch.optim.Optimizer):
    """The model and optimizer state under the Hugging Face model's names (the
    replicated trainer's checkpoint keys), each tensor this rank's shard: what
    torch.distributed.checkpoint saves and loads, re-sharding on load."""
    from torch.distributed.checkpoint.state_dict import get_state_dict

    from torch.distributed.checkpoint.state_dict import StateDictOptions

    return get_state_dict(root.module, optimizer,
                          options=StateDictOptions(ignore_frozen_params=True))


def load_policy_state(root: PolicyScorer, optimizer: torch.optim.Optimizer,
                      model_state, optim_state) -> None:
    from torch.distributed.checkpoint.state_dict import set_state_dict

    from torch.distributed.checkpoint.state_dict import StateDictOptions

    set_state_dict(root.module, optimizer, model_state_dict=model_state,
                   optim_state_dict=optim_state,
                   options=StateDictOptions(ignore_frozen_params=True, strict=False))


def gather_full_state(root: PolicyScorer) -> dict[str, torch.Tensor]:
    """The whole model state on rank 0's host memory under the model's names
    (an empty dict elsewhere), for the final export: every rank must call it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(root.module, options=StateDictOptions(
        full_state_dict=True, cpu_offload=True))


def send_sharded_weights(root: PolicyScorer, sync_group, bucket_bytes: int) -> int:
    """Weight sync from shards (paper §4.1 step 4): every rank of the FSDP group
    gathers the parameters bucket by bucket, in weightsync's bucket plan of the
    whole tensors, and rank 0, which holds the weight-sync group (`sync_group`;
    None elsewhere), broadcasts each bucket to the engines, who receive it as
    from a replicated trainer (weightsync.receive_weights). Rank 0 fills one
    byte buffer, sized for the largest bucket and reused by every bucket, from
    the gathered tensors one at a time, so the extra memory is that buffer plus
    one parameter on rank 0 and one parameter elsewhere. (A buffer per bucket
    would briefly be two: gloo's worker thread can still hold the last bucket's
    tensor when its broadcast's wait returns.) Returns the bytes broadcast."""
    from torch.distributed.tensor import DTensor

    from reflow.weightsync import broadcast_bucket, plan_buckets, specs_of

    named = policy_parameters(root)
    by_name = dict(named)
    buckets = plan_buckets(specs_of(named), bucket_bytes)
    staging = None
    if sync_group is not None and buckets:
        staging = torch.empty(max(sum(s.nbytes for s in b) for b in buckets),
                              dtype=torch.uint8, device=root_device(root))
    sent = 0
    failed: BaseException | None = None
    with torch.no_grad():
        for bucket in buckets:
            flat = None
            if staging is not None and failed is None:
                nbytes = sum(s.nbytes for s in bucket)
                flat = staging[:nbytes].view(bucket[0].torch_dtype)
            offset = 0
            for spec in bucket:
                p = by_name[spec.name]
                whole = p.full_tensor() if isinstance(p, DTensor) else p.detach()
                if flat is not None:
                    flat[offset:offset + spec.numel].copy_(whole.reshape(-1))
                offset += spec.numel
                del whole
            if flat is not None:
                try:
                    broadcast_bucket(sync_group, flat)
                    sent += flat.numel() * flat.element_size()
                except Exception as err:  # noqa: BLE001 - raised once every gather is done
                    # An engine is gone: the other ranks are in this publish's gathers
                    # to its last bucket, so this rank gathers on, sending nothing, and
                    # the FSDP group stays in step for the rebuilt weight sync.
                    failed = err
    if failed is not None:
        raise failed
    return sent


def root_device(root: PolicyScorer) -> torch.device:
    from torch.distributed.tensor import DTensor

    p = next(root.parameters())
    return p.to_local().device if isinstance(p, DTensor) else p.device
