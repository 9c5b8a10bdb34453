"""The leader's side of the trainer group's membership (paper §5): replicas
that join and leave at sync boundaries, and a group that loses a member.

Membership changes the scheduler asks for (`reconfigure`) wait for the next
sync boundary (`apply_membership`): the current replicas drop out, the new
membership joins a fresh group and receives the leader's state. An FSDP
group (trainer.parallelism: fsdp) changes instead by moving shards, each rank
its own rows (trainer/reshard.py, `_form_sharded_group`).

A replica whose worker died breaks the group mid-step: the step's collectives
fail on every rank (trainer/dp.py GroupBroken) before any optimizer step, so
the leader rebuilds the group at once from the replicas that stand by again
and trains the same batch, still leased, again (`_regroup_after`). The dead
replica is not waited for; the job goes on with one replica fewer. A lost
worker's engine leaves the weight-sync group the same way (`set_engines`,
from the scheduler, which knows which worker died), or a new engine takes its
place (an idle pod that replaced a lost rollout pod).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from reflow.core.errors import Unavailable
from reflow.core.restart_budget import CrashLoop
from reflow.procs import free_port
from reflow.trainer.dp import GroupBroken, TrainerGroup
from reflow.weightsync import new_rendezvous_key

logger = logging.getLogger(__name__)

# How long a rebuild waits for the surviving replicas to leave the broken group
# (each does once its collective fails, which the leader's abort makes at once).
PEER_STANDBY_WAIT_S = 60.0
# How long a rebuilt hsdp group waits for the scheduler to drop a lost replica's
# engines (it learns of a dead worker within seconds).
ENGINES_GONE_WAIT_S = 60.0
_PEER_POLL_S = 0.2
# How long a sync boundary waits for the scheduler to deal with a scripted flip
# due (a drain of the joining worker's engine included).
SCRIPTED_FLIP_WAIT_S = 300.0


class GroupMembership:
    """Membership methods of `TrainLoop` (trainer/loop.py), which holds the state
    they use (`group`, `peers`, `membership_epoch`, `_pending_peers`,
    `_pending_engines`, `_membership_lock`, `rollouts`, the model and optimizer)."""

    @property
    def group_timeout_s(self) -> float:
        """A replica waits for the leader's next command at most this long: a batch
        wait, plus a step."""
        return self.spec.trainer.batch_timeout_s + 600.0

    @property
    def group_size(self) -> int:
        return 1 + len(self.peers) if self.group is not None else 1

    def reconfigure(self, peers: list[str] | None, scripted_flips: int = 0) -> int:
        """The group's next replicas besides this leader (None: as they are);
        applied at the next step boundary after a publish (`apply_membership`).
        Returns the epoch it takes. A replica of the current group left out is
        asked whether it is still there (`_abandon_if_gone`): one that left by a
        role flip is, and stays in the group to that boundary; one whose worker
        died ends the step it holds up. `scripted_flips`: how many of the spec's
        cluster.flips the scheduler has dealt with (`await_scripted_flips`)."""
        with self._membership_changed:
            if peers is not None:
                self._pending_peers = list(peers)
            epoch = self.membership_epoch + (1 if self._pending_peers is not None else 0)
            self.scripted_flips_seen = max(self.scripted_flips_seen, scripted_flips)
            self._membership_changed.notify_all()
        if peers is not None:
            self._check_dropped()
        return epoch

    def await_scripted_flips(self) -> float:
        """Hold this sync boundary until the scheduler has dealt with every flip of
        the spec's cluster.flips at or before this step (carried it out, so its
        membership is pending now, or refused it). A scripted flip then takes
        effect at the first boundary at or after its step, however fast the steps
        run, and a short job cannot end before its flips. Flips Algorithm 1 asks
        for are not waited for: they follow the job, not a step. Returns the
        seconds waited; past SCRIPTED_FLIP_WAIT_S it warns and goes on."""
        due = sum(1 for flip in self.spec.cluster.flips if flip.at_step <= self.step)
        started = time.monotonic()
        deadline = started + SCRIPTED_FLIP_WAIT_S
        with self._membership_changed:
            while self.scripted_flips_seen < due and not self._stop.is_set():
                left = deadline - time.monotonic()
                if left <= 0:
                    logger.warning("job %s: step %d: %d of the %d scripted flips due were not "
                                   "reported in %.0fs; training goes on", self.job_id,
                                   self.step, self.scripted_flips_seen, due,
                                   SCRIPTED_FLIP_WAIT_S)
                    self.scripted_flips_seen = due
                    break
                self._membership_changed.wait(min(left, _PEER_POLL_S))
        return time.monotonic() - started

    def _check_dropped(self) -> None:
        """Ask the current group's replicas that a pending membership leaves out
        whether they are still there, on a thread of its own."""
        with self._membership_lock:
            group, pending = self.group, self._pending_peers
            dropped = [a for a in self.peers if pending is not None and a not in pending]
        if group is not None and dropped:
            threading.Thread(target=self._abandon_if_gone, args=(group, dropped), daemon=True,
                             name=f"{self.job_id}-liveness").start()

    def _abandon_if_gone(self, group: TrainerGroup, addresses: list[str]) -> None:
        """Abandon `group` if a replica of it in `addresses` does not answer as one
        of its members: its step would otherwise wait for the dead member until the
        group's timeout (trainer/dp.py TrainerGroup._await)."""
        for address in addresses:
            client = self._peer_client(address)
            try:
                status = client.status(self.job_id)
                gone = (status.state not in ("training", "joining")
                        or status.membership_epoch != group.epoch)
                reason = f"replica {address} is {status.state} in epoch {status.membership_epoch}"
            except Exception as err:  # noqa: BLE001 - unreachable: its worker is gone
                gone, reason = True, f"replica {address} unreachable ({type(err).__name__})"
            finally:
                client.close()
            if gone:
                logger.warning("job %s: trainer group epoch %d abandoned: %s", self.job_id,
                               group.epoch, reason)
                group.abandon(reason)
                return

    def _peer_client(self, address: str):
        from reflow.trainer.client import GrpcTrainerClient

        return (self._trainer_client_factory or GrpcTrainerClient)(address)

    def apply_membership(self) -> None:
        """Rebuild the group for a pending membership: the current replicas drop
        out (`regroup`), every replica of the new membership that stands by joins a
        fresh group and receives this leader's parameters and optimizer state."""
        with self._membership_lock:
            peers, self._pending_peers = self._pending_peers, None
        if peers is None:
            return
        if self.sharded:
            self._form_sharded_group(peers)
            return
        started = time.monotonic()
        if self.group is not None:
            try:
                self.group.send_command("regroup", self.step)
            except GroupBroken as err:  # a member died since the last step: it stays out
                logger.warning("job %s: regroup of a broken group: %s", self.job_id, err)
                self.group.abort()
            self.group = None
        self.last_handoff = ""
        # Replicas of the old group stand by once they have the regroup; a dead or
        # failed one is left out instead of holding the new group's rendezvous.
        peers, their_epochs = self._peers_standing_by(peers)
        # Above every epoch a replica has joined: a restarted leader's first group is
        # not refused as a stale one by the replicas its predecessor led.
        epoch = max([self.membership_epoch, *their_epochs]) + 1
        if peers:
            group = self._rendezvous(peers, lambda port, world, key: TrainerGroup.build(
                self.master_address, port, 0, world, epoch, self.device, self.group_timeout_s,
                rendezvous_key=key), epoch)
            self.last_handoff = group.transfer_state(self.model, self.optimizer,
                                                     self.shared_state)
            self.group = group
        with self._membership_lock:
            self.peers, self.membership_epoch = peers, epoch
        # A worker lost while this group formed: its reconfigure saw the old group.
        self._check_dropped()
        self.last_regroup_s = time.monotonic() - started
        logger.info("job %s: trainer group epoch %d: %d replicas (%.2fs%s)", self.job_id, epoch,
                    1 + len(peers), self.last_regroup_s,
                    f", state by {self.last_handoff}" if peers else "")

    def _rendezvous(self, peers: list[str], build, epoch: int):
        """Every replica in `peers` asked to join (rank 1, 2, ... on a new port, under
        a new rendezvous key) while this leader builds rank 0 (`build(port, world,
        key)`); returns the group once all have joined."""
        port, world, key = free_port(), 1 + len(peers), new_rendezvous_key()
        joins = [self._pool.submit(self._peer_client(address).join_group, self.job_id,
                                   port, rank, world, epoch, key)
                 for rank, address in enumerate(peers, start=1)]
        group = build(port, world, key)
        for f in joins:
            f.result()
        return group

    def _form_sharded_group(self, peers: list[str]) -> None:
        """trainer.parallelism: fsdp: every membership, the first included, by a
        plan of shard moves (trainer/reshard.py) over a union group of this leader,
        the current ranks and the replicas joining: the first shards the weights
        every rank loaded from model.path (a resumed job's ranks then load their
        shards of the checkpoint); a later one moves each rank's rows to their new
        owners, so a joiner receives its own shard and a leaver hands its shard on.
        Shards live nowhere else: a membership change with a current rank gone (a
        lost replica) cannot be applied and ends the job."""
        from reflow.trainer import reshard

        started = time.monotonic()
        initial = self.root is None
        first_step = self.resume_from.step if self.resume_from is not None else 0
        if initial and self.step != first_step:
            # The first membership shards what every rank loaded: weights this
            # leader has trained since would differ from a joiner's.
            raise RuntimeError(f"trainer.parallelism: fsdp: the group first forms at step "
                               f"{self.step}, after training began at step {first_step}")
        shards = self.spec.trainer.shard_size or 0
        # A broken hsdp group (`_regroup_after`): its survivors stand by holding their
        # shards, and join the union by RPC, as joiners do, with the ranks they had.
        broken = not initial and self.group is None
        old_rank = {a: i for i, a in enumerate(self.peers, start=1)}
        holders = [] if initial else list(self.peers)
        if broken:
            holders, gone = self._survivors(holders)
            self._await_engines_gone(gone)
        elif not initial:
            self._check_shard_holders(holders)
        # Joiners: not ranks of the current group (a rank a broken group lost is gone).
        joiners, their_epochs = self._peers_standing_by(
            [a for a in peers if a not in holders and a not in old_rank])
        epoch = max([self.membership_epoch, *their_epochs]) + 1
        # Union ranks: this leader, the current ranks in rank order, the joiners.
        union = [*holders, *joiners]
        members = [a for a in peers if a in union]
        if shards:
            # Whole replicas only: a survivor left over hands its rows on and leaves.
            members = members[:(1 + len(members)) // shards * shards - 1]
            union = [a for a in union if a in holders or a in members]
            joiners = [a for a in joiners if a in members]
        # Each rendezvous's key travels with its port: the union's in the JoinGroup
        # RPC and the current group's reshard command, the new group's in the plan.
        union_key = new_rendezvous_key()
        plan = reshard.ReshardPlan(
            epoch=epoch, port=free_port(), rendezvous_key=new_rendezvous_key(),
            old_ranks=[-1 if initial else 0, *[old_rank[a] for a in holders],
                       *[-1] * len(joiners)],
            new_ranks=[0, *[members.index(a) + 1 if a in members else -1 for a in union]],
            steps=[] if initial else reshard.optimizer_steps(self.root, self.optimizer),
            layout=reshard.layout_of(self.model if initial else self.root)[2], initial=initial,
            old_shards=0 if initial else shards, new_shards=shards)
        union_port, world = free_port(), 1 + len(union)
        try:
            if not initial and not broken:
                # The current ranks build the union group with this leader.
                self.group.send_command("reshard", self.step, arg=json.dumps(
                    {"port": union_port, "world": world, "epoch": epoch,
                     "rendezvous_key": union_key}))
            joins = [self._pool.submit(self._peer_client(address).join_group, self.job_id,
                                       union_port, rank, world, epoch, union_key)
                     for rank, address in enumerate(union, start=1)
                     if address in joiners or broken]
            group = TrainerGroup.build(self.master_address, union_port, 0, world, epoch,
                                       self.device, self.group_timeout_s,
                                       rendezvous_key=union_key)
            for f in joins:
                f.result()
            try:
                group._broadcast_bytes(plan.encode())
                reshard.apply_plan(self, plan, 0, group, self.master_address)
            finally:
                group.close()
        except GroupBroken as err:
            # Some rows may have moved and others not: no membership holds the state.
            raise RuntimeError(f"trainer.parallelism: fsdp: the move of shards to the group "
                               f"of epoch {epoch} failed ({err}); resume the job from its "
                               "last checkpoint") from err
        if initial and self.resume_from is not None:
            from reflow.trainer.checkpoint import load_shards

            self.group.send_command("resume", self.step, arg=str(self.resume_from.path))
            load_shards(self.resume_from.path, self.root, self.optimizer)
        if not initial:
            self.last_handoff = reshard.describe_moves(plan, self.root, [
                1 + union.index(a) for a in joiners])
        with self._membership_lock:
            self.peers, self.membership_epoch = members, epoch
        self._check_dropped()
        self.last_regroup_s = time.monotonic() - started
        logger.info("job %s: fsdp trainer group epoch %d: %d ranks (%.2fs%s)", self.job_id,
                    epoch, 1 + len(members), self.last_regroup_s,
                    f", {self.last_handoff}" if not initial else "")

    def _survivors(self, holders: list[str]) -> tuple[list[str], list[str]]:
        """The ranks of a broken hsdp group that stand by still holding the shards of
        its epoch, in rank order, and those that do not answer (a lost replica's:
        their workers are gone). Asked all at once:
        a dead one's status fails only after the channel's retries. One left in a
        collective with a rank that gave the step up leaves it at the mesh's timeout
        (fsdp._mesh_timeouts): it is waited for that long, and more."""
        deadline = (time.monotonic() + PEER_STANDBY_WAIT_S
                    + self.spec.trainer.collective_timeout_s)

        def standing_by(address: str) -> str:
            # A survivor still in the broken group's collective leaves it when told
            # to (one waiting for a command), or at the mesh's timeout (one inside
            # an FSDP collective): it is waited for.
            client = self._peer_client(address)
            try:
                try:
                    client.leave_group(self.job_id, self.membership_epoch)
                except Unavailable:
                    raise
                except Exception as err:  # noqa: BLE001 - its status says where it is
                    logger.info("job %s: rank %s not told to leave epoch %d: %s",
                                self.job_id, address, self.membership_epoch, err)
                while True:
                    status = client.status(self.job_id)
                    if (status.state == "standby"
                            and status.membership_epoch == self.membership_epoch):
                        return ""
                    if (status.state not in ("training", "joining")
                            or time.monotonic() > deadline or self.stopping):
                        return f"{status.state} in epoch {status.membership_epoch}"
                    time.sleep(_PEER_POLL_S)
            except Exception as err:  # noqa: BLE001 - its worker is gone
                return f"unreachable ({type(err).__name__})"
            finally:
                client.close()

        with ThreadPoolExecutor(max_workers=max(1, len(holders))) as pool:
            answers = list(pool.map(standing_by, holders))
        for address, why in zip(holders, answers):
            if why:
                logger.warning("job %s: rank %s of the broken group is %s: left out",
                               self.job_id, address, why)
        return ([a for a, why in zip(holders, answers) if not why],
                [a for a, why in zip(holders, answers) if why.startswith("unreachable")])

    def _await_engines_gone(self, lost: list[str]) -> None:
        """A lost replica's engines (an AsyncHybrid worker's engine dies with it)
        leave the weight-sync group before the next publish tries them (a send to a
        dead rank can wait out the group's timeout), once the scheduler says so: it
        tells the engines left their places first, and an engine dropped here before
        that would be asked to join at a place it does not know yet, and refuse.
        Past ENGINES_GONE_WAIT_S the publish finds them gone itself."""
        deadline = time.monotonic() + ENGINES_GONE_WAIT_S
        while any(c.address in lost for c in self.rollouts):
            self._apply_engines()
            if time.monotonic() > deadline or self.stopping:
                logger.warning("job %s: the scheduler has not dropped the lost replica's "
                               "engines within %.0fs", self.job_id, ENGINES_GONE_WAIT_S)
                return
            time.sleep(_PEER_POLL_S)

    def _check_shard_holders(self, holders: list[str]) -> None:
        """Every current rank of an FSDP group holds shards no other has: each must
        still be there, in this group, for its rows to move."""
        epoch = self.group.epoch if self.group is not None else -1
        for address in holders:
            client = self._peer_client(address)
            try:
                status = client.status(self.job_id)
                there = status.state == "training" and status.membership_epoch == epoch
                how = f"{status.state} in epoch {status.membership_epoch}"
            except Exception as err:  # noqa: BLE001 - unreachable: its worker is gone
                there, how = False, f"unreachable ({type(err).__name__})"
            finally:
                client.close()
            if not there:
                raise RuntimeError(
                    f"trainer.parallelism: fsdp: replica {address} ({how}) held shards of "
                    f"the trainer group of epoch {epoch} that no other rank holds, so the "
                    "group cannot change membership without it (a replica was lost?). "
                    "Resume the job from its last checkpoint, or use trainer.parallelism: "
                    "replicate or hsdp, whose group goes on without the lost replica")

    def _peers_standing_by(self, peers: list[str]) -> tuple[list[str], list[int]]:
        """The replicas of `peers` that stand by to join (in order), and the
        membership epochs they were last in: each is asked until it stands by, or
        answers that it cannot (failed, or not this job's), or does not answer (its
        worker is gone), for at most PEER_STANDBY_WAIT_S."""
        clients = {address: self._peer_client(address) for address in peers}
        ready: set[str] = set()
        epochs: list[int] = []
        waiting = list(peers)
        deadline = time.monotonic() + PEER_STANDBY_WAIT_S
        try:
            while waiting:
                for address in list(waiting):
                    try:
                        status = clients[address].status(self.job_id)
                        state = status.state
                    except Exception as err:  # noqa: BLE001 - unreachable or unknown: left out
                        state = f"unreachable ({type(err).__name__})"
                    if state in ("starting", "standby"):
                        ready.add(address)
                        epochs.append(int(status.membership_epoch))
                    if state not in ("training", "joining"):
                        waiting.remove(address)
                        if address not in ready:
                            logger.warning("job %s: trainer replica %s left out of the group: "
                                           "%s", self.job_id, address, state)
                if not waiting or time.monotonic() > deadline or self.stopping:
                    break
                time.sleep(_PEER_POLL_S)
        finally:
            for client in clients.values():
                client.close()
        return [a for a in peers if a in ready], epochs

    def _regroup_after(self, err: GroupBroken) -> None:
        """The group broke during a step (a replica's worker died): rebuild it now
        from the replicas still there, so that the step can run again. Bounded by
        cluster.max_restarts within cluster.restart_window_s (a crash loop fails)."""
        self.group_failures += 1
        budget, now = self.spec.cluster.restart_budget(), time.time()
        try:
            budget.admit("the trainer group", self.group_failure_times, now)
        except CrashLoop as loop:
            raise RuntimeError(f"{loop}: {err}") from err
        self.group_failure_times = [*budget.recent(self.group_failure_times, now), now]
        broken, self.group = self.group, None
        if broken is not None:
            broken.abort()  # the survivors' collectives fail now, and they stand by
        if self.sharded and not self.spec.trainer.shard_size:
            raise RuntimeError(f"trainer.parallelism: fsdp: the trainer group broke at step "
                               f"{self.step + 1} ({err}); its lost rank's shards are nowhere "
                               "else. Resume the job from its last checkpoint, or use "
                               "trainer.parallelism: replicate or hsdp, whose group goes on "
                               "without the lost replica") from err
        logger.warning("job %s: trainer group broke at step %d (%s); rebuilding it",
                       self.job_id, self.step + 1, err)
        with self._membership_lock:
            # A change the scheduler asked for meanwhile is applied with the rebuild.
            if self._pending_peers is None:
                self._pending_peers = list(self.peers)
        self.apply_membership()

    # --- the rollout engines ----------------------------------------------------------

    def set_engines(self, addresses: list[str], new_client=None) -> None:
        """The rollout engines from now on, in weight-sync rank order: those the job
        has, less any that left (a lost worker's, or one given back to another
        job), with a new address where a lost one's was (an idle pod took its
        place) or new ones after the last (the job grew into free workers); the
        scheduler started each new engine at its rank. `new_client(address)` makes
        a new engine's client. Applied on the training thread (`_apply_engines`);
        the next publish builds a weight-sync group over the new set and sends it
        the current version whole."""
        known = [c.address for c in self.rollouts]
        if len(set(addresses)) != len(addresses):
            raise ValueError("rollout_addresses: an engine is listed twice")
        kept = [a for a in addresses if a in known]
        if kept != [a for a in known if a in kept]:
            raise ValueError("rollout_addresses: the job's engines keep their order (a rank "
                             "only falls, as engines below it leave)")
        joining = [a for a in addresses if a not in known]
        if joining and new_client is None:
            raise ValueError(f"rollout_addresses: {joining[0][:80]!r} is not an engine of this "
                             "job, and this trainer cannot reach new ones")
        with self._membership_lock:
            self._pending_engines = (list(addresses), new_client)

    def _apply_engines(self) -> None:
        with self._membership_lock:
            pending, self._pending_engines = self._pending_engines, None
        if pending is None:
            return
        addresses, new_client = pending
        current = {c.address: c for c in self.rollouts}
        if list(current) == addresses:
            return
        gone = [a for a in current if a not in addresses]
        joined = [a for a in addresses if a not in current]
        # In place: the evaluation thread holds the same list.
        self.rollouts[:] = [current[a] if a in current else new_client(a) for a in addresses]
        for address in gone:
            self._stats_polls.pop(address, None)
            self.retired_engines.append(address)
        # The group built over the old engine set cannot carry the next version.
        self._engines_changed = True
        self._fit_thread_pools()
        logger.warning("job %s: rollout engines now %d: %s joined, %s left", self.job_id,
                       len(self.rollouts), ", ".join(joined) or "none", ", ".join(gone) or "none")

    def _fit_thread_pools(self) -> None:
        """A publish runs every engine's update call beside the broadcast, each on a
        thread of `_pool`: with fewer threads than engines plus one, the broadcast
        would queue behind updates that wait for it. A job that grew gets larger
        pools (the old ones finish what they run)."""
        need = len(self.rollouts) + 1
        for name, prefix in (("_pool", "wsync"), ("_check_pool", "sync-check")):
            pool = getattr(self, name)
            if pool._max_workers < need:
                setattr(self, name, ThreadPoolExecutor(max_workers=need,
                                                       thread_name_prefix=prefix))
                pool.shutdown(wait=False)
