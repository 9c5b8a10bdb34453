"""The data-parallel trainer group (trainer/dp.py): replicas that split each
batch over a real gloo group take the single trainer's step, keep identical
weights after every step, and a replica that joins later receives the leader's
parameters and optimizer state."""

import os
import threading

import pytest
import torch

from reflow.core.config import parse_job_spec
from reflow.core.types import Batch
from reflow.trainer.client import TrainerStatus
from reflow.trainer.dp import GroupBroken, shard_indices
from reflow.trainer.loop import TrainLoop
from reflow.trainer.replica import TrainerReplica

from tests.unit.test_micro_batches import _Replay, _trajectories


def test_shards_cover_the_batch_once_and_balance_tokens():
    lengths = [30, 2, 17, 9, 5, 3, 1, 30]
    shards = [shard_indices(lengths, r, 3) for r in range(3)]
    assert sorted(i for s in shards for i in s) == list(range(len(lengths)))
    loads = [sum(lengths[i] for i in s) for s in shards]
    assert max(loads) - min(loads) <= max(lengths)
    with pytest.raises(ValueError, match="rank 3"):
        shard_indices(lengths, 3, 3)


class _ReplicaClient:
    """The leader's view of a replica: join_group on the replica in this process."""

    replicas: dict[str, TrainerReplica] = {}

    def __init__(self, address: str) -> None:
        self.replica = self.replicas[address]

    def join_group(self, job_id, port, rank, world, epoch, rendezvous_key):
        self.replica.join(port, rank, world, epoch, rendezvous_key)

    def status(self, job_id):
        return TrainerStatus(job_id, self.replica.state, self.replica.step, 0,
                             membership_epoch=self.replica.epoch)

    def close(self):
        pass


def _spec(tiny_model):
    return parse_job_spec({"model": {"path": tiny_model}, "trainer": {"max_grad_norm": 1e6},
                           "replay": {"replay_weight": 0.5}})


def _leader(spec):
    loop = TrainLoop("job", spec, _Replay(), rollouts=[], device=torch.device("cpu"),
                     trainer_client_factory=_ReplicaClient)
    loop.load()
    return loop


def _replica(spec, address):
    replica = TrainerReplica("job", spec, "127.0.0.1", device=torch.device("cpu"))
    replica.load()
    assert replica.state == "standby"
    _ReplicaClient.replicas[address] = replica
    return replica


def _wait(predicate, timeout_s=60.0):
    done = threading.Event()
    for _ in range(int(timeout_s / 0.05)):
        if predicate():
            return
        done.wait(0.05)
    raise AssertionError("condition not reached")


def _params(model):
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _step(loop, trajectories):
    loop.step += 1
    return loop._train_step(Batch(lease_id="l", trajectories=trajectories))


def test_group_step_equals_the_single_trainer_step_and_replicas_stay_identical(tiny_model):
    spec = _spec(tiny_model)
    batches = [_trajectories(16, vocab=20) for _ in range(3)]
    alone = _leader(spec)
    alone_results = [_step(alone, b) for b in batches]

    leader = _leader(spec)
    replica = _replica(spec, "replica-a:1")
    # Desynchronise the replica first: joining must overwrite its state.
    with torch.no_grad():
        next(replica.loop.model.parameters()).add_(1.0)
    leader.reconfigure(["replica-a:1"])
    leader.apply_membership()
    assert leader.group is not None and leader.group_size == 2 and leader.membership_epoch == 1
    _wait(lambda: replica.state == "training")
    for batch, expected in zip(batches, alone_results):
        (stats, grad_norm), sample_stats = _step(leader, batch)
        (want_stats, want_norm), want_samples = expected
        assert grad_norm == pytest.approx(want_norm, rel=1e-4)
        assert stats.loss == pytest.approx(want_stats.loss, rel=1e-4, abs=1e-6)
        for sample_id, s in want_samples.items():
            assert sample_stats[sample_id] == pytest.approx(s, rel=1e-4, abs=1e-6)
        _wait(lambda: replica.steps_trained == leader.step)
        mine, theirs = _params(leader.model), _params(replica.loop.model)
        for name in mine:
            assert torch.equal(mine[name], theirs[name]), name
    # Against the lone trainer: the same up to summation order (Adam rescales the
    # last bits of near-zero gradients, hence the absolute tolerance).
    for name, p in _params(alone.model).items():
        torch.testing.assert_close(_params(leader.model)[name], p, rtol=1e-3, atol=1e-4)

    # The replica leaves (regroup), and the leader trains alone again.
    leader.reconfigure([])
    leader.apply_membership()
    _wait(lambda: replica.state == "standby")
    assert leader.group is None and leader.group_size == 1 and leader.membership_epoch == 2
    _step(leader, batches[0])
    assert replica.steps_trained == 3


def test_a_late_joiner_receives_parameters_and_optimizer_state(tiny_model):
    spec = _spec(tiny_model)
    leader = _leader(spec)
    for _ in range(2):
        _step(leader, _trajectories(8, vocab=20))
    late = _replica(spec, "replica-b:1")
    # Warm: AdamW's state allocated at load, as a never-stepped optimizer's (step 0, zeros).
    for q in late.loop.model.parameters():
        state = late.loop.optimizer.state[q]
        assert state["step"].item() == 0 and not state["exp_avg"].any()
    leader.reconfigure(["replica-b:1"])
    leader.apply_membership()
    _wait(lambda: late.state == "training")
    for p, q in zip(leader.model.parameters(), late.loop.model.parameters()):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(leader.optimizer.state[p][key], late.loop.optimizer.state[q][key])
    _step(leader, _trajectories(8, vocab=20))
    _wait(lambda: late.steps_trained == 1)
    for p, q in zip(leader.model.parameters(), late.loop.model.parameters()):
        assert torch.equal(p, q)
    leader.group.send_command("stop", leader.step)
    _wait(lambda: late.state == "succeeded")


def test_join_is_validated(tiny_model):
    replica = TrainerReplica("job", _spec(tiny_model), "127.0.0.1", device=torch.device("cpu"))
    replica.load()
    key = "ab" * 16
    with pytest.raises(ValueError, match="master_port"):
        replica.join(0, 1, 2, 1, key)
    with pytest.raises(ValueError, match="rank/world_size"):
        replica.join(1234, 0, 2, 1, key)
    with pytest.raises(Exception, match="membership_epoch"):
        replica.join(1234, 1, 2, 0, key)
    # No unkeyed join: the leader always hands out the group's key.
    for bad in ("", "AB" * 16, key[:-2], key + "ab"):
        with pytest.raises(ValueError, match="rendezvous_key"):
            replica.join(1234, 1, 2, 1, bad)
    assert replica.state == "standby" and replica.epoch == 0


def _elastic_spec(tiny_model, handoff="auto"):
    return parse_job_spec({"model": {"path": tiny_model}, "trainer": {"max_grad_norm": 1e6},
                           "cluster": {"workers": 2, "state_handoff": handoff}})


def _assert_same_state(leader, replica):
    for p, q in zip(leader.model.parameters(), replica.loop.model.parameters()):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(leader.optimizer.state[p][key], replica.loop.optimizer.state[q][key])


def _in_shared_file(leader, tensor):
    base = leader.shared_state.views[0].data_ptr()
    return base <= tensor.data_ptr() < base + leader.shared_state.size


def test_a_replica_on_the_leaders_host_copies_the_state_from_shared_memory(tiny_model):
    """On CPU an elastic job's leader trains with its parameters and AdamW state in
    a memfd; a joining replica on the same host copies them from there instead of
    receiving a broadcast, and the group then trains identically."""
    spec = _elastic_spec(tiny_model)
    leader = _leader(spec)
    expected = _leader(spec)  # the same steps, with private state
    leader.share_state()
    assert leader.shared_state is not None
    for _ in range(2):
        _step(leader, _trajectories(8, vocab=20))
        _step(expected, _trajectories(8, vocab=20))
    # The optimizer updated the shared file in place: it holds the current state.
    for p, q in zip(leader.model.parameters(), expected.model.parameters()):
        assert _in_shared_file(leader, p) and _in_shared_file(leader, leader.optimizer.state[p]["exp_avg"])
        assert torch.equal(p, q)
    late = _replica(spec, "replica-c:1")
    leader.reconfigure(["replica-c:1"])
    leader.apply_membership()
    assert leader.last_handoff == "shared_memory"
    _wait(lambda: late.state == "training")
    _assert_same_state(leader, late)
    _step(leader, _trajectories(8, vocab=20))
    _wait(lambda: late.steps_trained == 1)
    _assert_same_state(leader, late)
    leader.group.send_command("stop", leader.step)
    _wait(lambda: late.state == "succeeded")
    # At the end the state goes back to private memory, values unchanged.
    before = _params(leader.model)
    leader.unshare_state()
    assert leader.shared_state is None
    for name, p in leader.model.named_parameters():
        assert torch.equal(p, before[name])


def test_an_fsdp_leader_keeps_its_shards_private_and_says_why(tiny_model, caplog):
    """FSDP shards move point to point at a flip: the same-host hand-off is for
    replicated groups, and the leader's log says so instead of skipping it silently."""
    spec = parse_job_spec({"model": {"path": tiny_model},
                           "trainer": {"max_grad_norm": 1e6, "parallelism": "fsdp"},
                           "cluster": {"workers": 2}})
    leader = _leader(spec)
    assert leader.sharded
    with caplog.at_level("INFO", logger="reflow.trainer.loop"):
        leader.share_state()
    assert leader.shared_state is None
    assert "same-host shared-memory hand-off is for replicated groups" in caplog.text


@pytest.mark.parametrize("tamper", ["token", "pid", "layout", "off"])
def test_a_hand_off_that_does_not_check_out_falls_back_to_the_broadcast(tiny_model, monkeypatch,
                                                                         tamper):
    """Another process's file, a wrong token or another model's layout: the replica
    copies nothing from it, and the whole group takes the broadcast instead."""
    from dataclasses import replace

    from reflow.trainer import handoff

    spec = _elastic_spec(tiny_model, "broadcast" if tamper == "off" else "auto")
    leader = _leader(spec)
    leader.share_state()
    assert (leader.shared_state is None) == (tamper == "off")
    _step(leader, _trajectories(8, vocab=20))
    if tamper != "off":
        real = leader.shared_state.descriptor()
        wrong = {"token": replace(real, token="0" * 32),
                 "pid": replace(real, pid=os.getppid()),
                 "layout": replace(real, layout="f" * 64)}[tamper]
        monkeypatch.setattr(handoff.SharedState, "descriptor", lambda self: wrong)
    late = _replica(spec, f"replica-{tamper}:1")
    leader.reconfigure([f"replica-{tamper}:1"])
    leader.apply_membership()
    assert leader.last_handoff == "broadcast"
    _wait(lambda: late.state == "training")
    _assert_same_state(leader, late)
    leader.group.send_command("stop", leader.step)
    _wait(lambda: late.state == "succeeded")
    leader.unshare_state()


@pytest.mark.parametrize("raw", [
    b"", b"[]", b'{"pid": 1}', b"x" * 5000,
    b'{"pid": "1", "fd": 3, "size": 10, "token": "' + b"0" * 32 + b'", "layout": "' + b"0" * 64 + b'"}',
    b'{"pid": 1, "fd": 3, "size": 10, "token": "../etc/passwd", "layout": "' + b"0" * 64 + b'"}',
    b'{"pid": -1, "fd": 3, "size": 10, "token": "' + b"0" * 32 + b'", "layout": "' + b"0" * 64 + b'"}',
])
def test_hand_off_descriptors_are_validated(raw):
    from reflow.trainer.handoff import Descriptor

    with pytest.raises(ValueError):
        Descriptor.decode(raw)


def test_a_descriptor_naming_a_file_that_is_not_a_trainer_memfd_is_not_copied(tmp_path):
    """A descriptor pointing at any other open file of this process (here a regular
    file full of bytes) is refused before anything is mapped or copied."""
    from reflow.trainer.handoff import Descriptor, copy_from_leader, layout_digest

    target = torch.zeros(4)
    path = tmp_path / "not-state"
    path.write_bytes(b"\xff" * 4096)
    fd = os.open(path, os.O_RDONLY)
    try:
        wrong = Descriptor(os.getpid(), fd, 4096, "0" * 32, layout_digest([target]))
        with pytest.raises(ValueError, match="not a trainer-state memfd"):
            copy_from_leader(wrong, [target])
        with pytest.raises(OSError):  # no such descriptor in this process
            copy_from_leader(Descriptor(os.getpid(), 999_999, 4096, "0" * 32,
                                        layout_digest([target])), [target])
    finally:
        os.close(fd)
    assert not target.any()


class _GoneClient(_ReplicaClient):
    """A replica whose worker died: its status call fails."""

    def status(self, job_id):
        raise ConnectionError("connection refused")


def test_a_replica_left_out_is_abandoned_only_when_it_is_gone(tiny_model):
    spec = _spec(tiny_model)
    leader = _leader(spec)
    replica = _replica(spec, "replica-c:1")
    leader.reconfigure(["replica-c:1"])
    leader.apply_membership()
    _wait(lambda: replica.state == "training")
    group = leader.group
    # A role flip: the replica still answers as a member and stays to the boundary.
    leader.reconfigure([])
    _wait(lambda: not [t for t in threading.enumerate() if t.name == "job-liveness"])
    assert not group.abandoned.is_set()
    # Its worker died: the step it would hold up ends now.
    leader._trainer_client_factory = _GoneClient
    leader.reconfigure([])
    _wait(group.abandoned.is_set)
    assert "replica replica-c:1 unreachable (ConnectionError)" in group.abandon_reason
    with pytest.raises(GroupBroken, match="abandoned"):
        group.send_command("train", 1)
    leader._regroup_after(GroupBroken("test"))  # the rebuild: the leader alone
    assert leader.group is None and leader.peers == []


def test_a_boundary_waits_for_the_scripted_flips_due_and_no_longer(tiny_model):
    """cluster.flips at step 2: the leader's boundary after step 2 waits until the
    scheduler reports the flip (its membership, or a refusal), so it lands at that
    boundary however fast the steps run; before step 2 nothing is waited for."""
    spec = parse_job_spec({"model": {"path": tiny_model}, "trainer": {"num_steps": 5},
                           "scheduler": {"placement": False},
                           "cluster": {"workers": 3, "trainer_workers": 1, "flips": [
                               {"at_step": 2, "worker": 1, "role": "trainer"}]}})
    leader = _leader(spec)
    leader.step = 1
    assert leader.await_scripted_flips() < 0.05  # none due yet
    leader.step = 2
    waited: list[float] = []
    boundary = threading.Thread(target=lambda: waited.append(leader.await_scripted_flips()))
    boundary.start()
    boundary.join(0.5)
    assert boundary.is_alive()  # held: the flip due is not reported
    assert leader.reconfigure(["replica-d:1"], scripted_flips=1) == 1
    boundary.join(10)
    assert not boundary.is_alive() and waited[0] >= 0.5
    assert leader._pending_peers == ["replica-d:1"]  # applied by apply_membership next
    # A report alone (a refused flip) leaves the pending membership as it is.
    assert leader.reconfigure(None, scripted_flips=1) == 1
    assert leader._pending_peers == ["replica-d:1"]


def test_a_lora_joiner_takes_the_adapters_and_their_adamw_state_only(tiny_model):
    """A role flip in a LoRA job moves the adapters and their optimizer state; the
    frozen base weights are model.path's on every rank and never move."""
    spec = parse_job_spec({"model": {"path": tiny_model}, "trainer": {"max_grad_norm": 1e6},
                           "cluster": {"workers": 2, "state_handoff": "auto"},
                           "lora": {"rank": 4, "alpha": 8}})
    leader = _leader(spec)
    leader.share_state()
    for _ in range(2):
        _step(leader, _trajectories(8, vocab=20))
    whole = sum(p.numel() * p.element_size() for p in leader.model.parameters())
    adapters = [p for p in leader.model.parameters() if p.requires_grad]
    # Adapters, then two AdamW moments and a step count each: a fraction of the model.
    assert leader.shared_state.size < whole / 2
    late = _replica(spec, "replica-d:1")
    with torch.no_grad():  # a joiner's own adapters must be overwritten
        next(p for p in late.loop.model.parameters() if p.requires_grad).add_(1.0)
    leader.reconfigure(["replica-d:1"])
    leader.apply_membership()
    _wait(lambda: late.state == "training")
    trained = [q for q in late.loop.model.parameters() if q.requires_grad]
    assert len(trained) == len(adapters)
    for p, q in zip(adapters, trained):
        assert torch.equal(p, q)
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(leader.optimizer.state[p][key], late.loop.optimizer.state[q][key])
    _step(leader, _trajectories(8, vocab=20))
    _wait(lambda: late.steps_trained == 1)
    for p, q in zip(leader.model.parameters(), late.loop.model.parameters()):
        assert torch.equal(p, q)
    leader.group.send_command("stop", leader.step)
    _wait(lambda: late.state == "succeeded")
    leader.unshare_state()
