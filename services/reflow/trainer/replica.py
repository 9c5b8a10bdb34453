"""A trainer replica of an elastic job: the trainer half of an AsyncHybrid
worker (paper §5) while another worker holds trainer rank 0.

It loads the model and optimizer when the job starts, so it is warm before it
is ever needed, then stands by. When the leader brings it into the trainer
group (`join`), it receives the leader's parameters and optimizer state and
follows the leader's commands: compute its share of each batch (trainer/step.py),
drop out on `regroup`, end on `stop`. Between memberships its state stays in
this process's memory. In an FSDP group it joins with no shards and receives
its own from their owners, and a `reshard` moves its rows to the next
membership, with it or without it (trainer/reshard.py).
"""

from __future__ import annotations

import json
import logging
import threading
import time

import torch

from reflow.core.config import JobSpec
from reflow.core.errors import FailedPrecondition
from reflow.trainer.dp import GroupBroken, TrainerGroup
from reflow.trainer.handoff import materialise_optimizer_state
from reflow.trainer.loop import TrainLoop
from reflow.trainer.schedule import set_learning_rate
from reflow.trainer.step import compute_step
from reflow.weightsync import check_rendezvous_key

logger = logging.getLogger(__name__)

MAX_GROUP_SIZE = 4096
# Commands of an FSDP group, each a collective this replica joins.
SHARDED_OPS = ("publish", "probe", "checkpoint", "resume", "export")


class TrainerReplica:
    def __init__(self, job_id: str, spec: JobSpec, leader_host: str,
                 device: torch.device | None = None) -> None:
        self.job_id = job_id
        self.leader_host = leader_host
        # The loop's model, optimizer and tokenizer; it never runs or sees the buffer.
        self.loop = TrainLoop(job_id, spec, None, rollouts=[], device=device)
        self.state = "starting"
        self.error = ""
        self.step = 0
        self.epoch = 0
        self.steps_trained = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._loaded = threading.Event()
        self._thread: threading.Thread | None = None
        # hsdp: this rank's rank in the group that broke, whose shards it still holds.
        self.broken_rank: int | None = None
        self._group: TrainerGroup | None = None  # the group it follows now

    def load(self) -> None:
        try:
            self.loop.load()
            # Warm means allocated: AdamW's moments exist (zeros) from the start, so a
            # flip only copies into memory the replica already holds. Sharded, the
            # optimizer is rebuilt over the shards when the group forms.
            if not self.loop.sharded:
                materialise_optimizer_state(self.loop.optimizer)
            with self._lock:
                if self.state == "starting":
                    self.state = "standby"
        except Exception as err:  # noqa: BLE001 - reported through GetStatus
            logger.exception("job %s: replica failed to load", self.job_id)
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"
        finally:
            self._loaded.set()

    def join(self, master_port: int, rank: int, world_size: int, epoch: int,
             rendezvous_key: str) -> None:
        """Join the leader's group of this epoch (returns at once; the group is built
        on a thread, as the leader builds its side), under the rendezvous key the
        leader drew for it."""
        check_rendezvous_key(rendezvous_key)
        if not 1 <= master_port <= 65535:
            raise ValueError(f"master_port: {master_port} is not a port")
        if not 1 <= rank < world_size <= MAX_GROUP_SIZE:
            raise ValueError(f"rank/world_size: {rank}/{world_size}; need 1 <= rank < "
                             f"world_size <= {MAX_GROUP_SIZE} (the leader is rank 0)")
        with self._lock:
            if epoch <= self.epoch:
                raise FailedPrecondition(f"membership_epoch: {epoch} is not after this "
                                         f"replica's epoch {self.epoch}")
            # A join may arrive while the replica still loads: it waits for the load.
            if self.state not in ("starting", "standby"):
                raise FailedPrecondition(f"this replica is {self.state}, not standing by")
            self.state, self.epoch = "joining", epoch
            self._thread = threading.Thread(target=self._follow,
                                            args=(master_port, rank, world_size, epoch,
                                                  rendezvous_key),
                                            name="trainer-replica", daemon=True)
            self._thread.start()

    def leave(self, epoch: int) -> None:
        """The leader gave up the group of `epoch` (a rank of it was lost): the
        collective this replica waits in ends with GroupBroken, and it stands by.
        Its own collectives with the leader do not fail by themselves when the
        group is FSDP's, which keeps the group's connections open (fsdp.py)."""
        with self._lock:
            group = self._group
            if group is None or self.epoch != epoch or self.state != "training":
                return  # left already, or not in that group
        group.abandon(f"the leader gave up the group of epoch {epoch}")

    def _follow(self, master_port: int, rank: int, world_size: int, epoch: int,
                rendezvous_key: str) -> None:
        loop = self.loop
        group = None
        try:
            if not self._loaded.wait(loop.group_timeout_s) or self.error:
                raise RuntimeError(f"the replica did not load: {self.error or 'timed out'}")
            started = time.monotonic()
            if loop.sharded:
                group, how = self._join_sharded(master_port, rank, world_size, epoch,
                                                rendezvous_key)
                if group is None:  # a survivor left over, not a whole replica: rows handed on
                    self.state = "standby"
                    return
            else:
                group = TrainerGroup.build(self.leader_host, master_port, rank, world_size,
                                           epoch, loop.device, loop.group_timeout_s,
                                           rendezvous_key=rendezvous_key)
                how = group.transfer_state(loop.model, loop.optimizer)
            logger.info("job %s: replica rank %d/%d of epoch %d, state %s in %.2fs",
                        self.job_id, rank, world_size, epoch, how, time.monotonic() - started)
            if self._stop.is_set():
                return
            self.state = "training"
            while not self._stop.is_set():
                self._group = group
                op, step, trajectories, arg = group.receive_command()
                if op == "train":
                    # The leader's rate for this step, from its number (schedule.py).
                    loop.learning_rate = set_learning_rate(loop.optimizer, loop.spec.trainer,
                                                           step)
                    # loop.load() built the same frozen reference as the leader's.
                    compute_step(loop.trained, loop.optimizer, loop.spec, trajectories,
                                 loop.pad_id, loop.device, group, reference=loop.reference,
                                 step=step, stop_ids=loop.stop_ids)
                    self.step = step
                    self.steps_trained += 1
                elif op in SHARDED_OPS and loop.root is not None:
                    self._sharded_command(op, arg)
                elif op == "reshard" and loop.root is not None:
                    group = self._reshard(group, arg)
                    if group is None:  # left the group: its shards went to the others
                        if not self._stop.is_set():
                            self.state = "standby"
                        return
                elif op == "regroup":
                    if not self._stop.is_set():
                        self.state = "standby"
                    return
                elif op == "stop":
                    if loop.root is not None:
                        group.close()  # this process's default group
                    if not self._stop.is_set():
                        self.state = "succeeded"
                    return
                else:
                    raise ValueError(f"trainer group: unknown command {op!r}")
        except GroupBroken as err:
            # A peer died or the leader gave the group up: this replica's state is
            # whatever the leader sends at its next join, so it stands by for that.
            if group is not None:
                group.abort()
            if not self._stop.is_set():
                logger.warning("job %s: replica left broken group of epoch %d: %s",
                               self.job_id, self.epoch, err)
                if loop.root is not None and loop.spec.trainer.shard_size and group is not None:
                    # hsdp: another replica holds what a lost one held, so this rank's
                    # shards go on into the group the leader forms from the survivors.
                    self.broken_rank, loop.group = group.rank, None
                    self.state = "standby"
                else:
                    # fsdp: its shards are of a group that is gone; it cannot rejoin.
                    self.state = "standby" if loop.root is None else "failed"
                    if loop.root is not None:
                        self.error = f"fsdp trainer group broke: {err}"[:1000]
        except Exception as err:  # noqa: BLE001 - reported through GetStatus
            if self._stop.is_set():
                logger.info("job %s: stopped replica left its group: %s", self.job_id, err)
                return
            logger.exception("job %s: replica failed", self.job_id)
            if group is not None:
                group.abort()  # the leader's collective with it fails now, not at a timeout
            self.state, self.error = "failed", f"{type(err).__name__}: {err}"

    def _join_sharded(self, master_port: int, rank: int, world_size: int, epoch: int,
                      rendezvous_key: str):
        """Join an FSDP group's membership change (trainer/reshard.py) as a process
        with no shards yet: the union group the leader named, its plan, then this
        process's new shards, sharded from the weights it loaded (the first
        membership) or received from their current owners. Returns (group, how)."""
        from reflow.trainer import reshard

        loop = self.loop
        union = TrainerGroup.build(self.leader_host, master_port, rank, world_size, epoch,
                                   loop.device, loop.group_timeout_s,
                                   rendezvous_key=rendezvous_key)
        try:
            plan = reshard.ReshardPlan.decode(union._broadcast_bytes(None))
            # A joiner holds no shards; a survivor of a broken hsdp group its old rank's.
            held = self.broken_rank if loop.root is not None else None
            if (plan.epoch != epoch or len(plan.new_ranks) != world_size
                    or plan.old_ranks[rank] != (-1 if held is None else held)
                    or (plan.new_ranks[rank] < 0 and held is None)):
                raise ValueError(f"reshard plan: not a join of union rank {rank}/{world_size} "
                                 f"in epoch {epoch}")
            group, received = reshard.apply_plan(loop, plan, rank, union, self.leader_host)
            self.broken_rank = None
        finally:
            union.close()
        return group, ("sharded in place" if plan.initial else f"{received} B of shards")

    def _reshard(self, group, arg: str):
        """The leader changes the FSDP group's membership: this rank's rows move to
        their new owners over a union group (trainer/reshard.py). Returns the new
        group, or None where this rank left it."""
        from reflow.trainer import reshard

        loop = self.loop
        try:
            order = json.loads(arg)
            port, world, epoch = int(order["port"]), int(order["world"]), int(order["epoch"])
            key = check_rendezvous_key(order["rendezvous_key"])
        except (ValueError, KeyError, TypeError) as err:
            # Not the command itself: it holds the union's rendezvous key.
            raise ValueError(f"trainer group: reshard command: {err}") from None
        if not (1 <= port <= 65535 and group.world_size <= world <= MAX_GROUP_SIZE
                and epoch > self.epoch):
            raise ValueError(f"trainer group: reshard to port {port}, {world} ranks, epoch "
                             f"{epoch} from epoch {self.epoch}")
        me = group.rank  # the union lists the current ranks first, in rank order
        union = TrainerGroup.build(self.leader_host, port, me, world, epoch, loop.device,
                                   loop.group_timeout_s, rendezvous_key=key)
        try:
            plan = reshard.ReshardPlan.decode(union._broadcast_bytes(None))
            if plan.epoch != epoch or len(plan.old_ranks) != world or plan.old_ranks[me] != me:
                raise ValueError(f"reshard plan: not one for rank {me} of epoch {group.epoch}")
            new_group, received = reshard.apply_plan(loop, plan, me, union, self.leader_host)
        finally:
            union.close()
        with self._lock:
            self.epoch = epoch
        logger.info("job %s: replica rank %d of epoch %d is %s of epoch %d (%d B of shards "
                    "received)", self.job_id, me, group.epoch,
                    f"rank {new_group.rank}" if new_group is not None else "out", epoch,
                    received)
        return new_group

    def _sharded_command(self, op: str, arg: str) -> None:
        """A collective of the FSDP group the leader started: this rank's part."""
        from reflow.trainer import checkpoint
        from reflow.trainer.fsdp import gather_full_state, send_sharded_weights
        from reflow.weightsync import DEFAULT_BUCKET_BYTES

        loop = self.loop
        if op == "publish":
            send_sharded_weights(loop.root, None, DEFAULT_BUCKET_BYTES)
            loop.probe_expected()  # the leader scores the probe after each publish
        elif op == "probe":
            loop.probe_expected()
        elif op == "checkpoint":
            checkpoint.write_shards(checkpoint.check_shard_dir(arg), loop.root, loop.optimizer)
        elif op == "resume":
            checkpoint.load_shards(checkpoint.check_shard_dir(arg), loop.root, loop.optimizer)
        elif op == "export":
            gather_full_state(loop.root)  # rank 0 keeps the whole weights, not this one

    def stop(self) -> None:
        """End this replica's part in the job. A replica blocked in a collective of a
        group whose leader is gone is released by the group's timeout; it reports
        stopped from now on, so the worker can take another job meanwhile."""
        self._stop.set()
        if self.state not in ("succeeded", "failed"):
            self.state = "stopped"
