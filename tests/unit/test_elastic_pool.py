"""The elastic pool's role flips (scheduler/placement/elastic.py) over real RolloutWorkers,
the real Dispatcher and real HybridWorkers, with a scripted trainer leader:
a worker leaving rollout is taken out of routing, its samples in flight finish
into the buffer (none lost), and the leader's group gains it at a sync
boundary; a worker coming back is routed to again. Requests that would break
the pool are refused with the field named."""

import time

import pytest

from reflow.core.config import parse_job_spec
from reflow.core.errors import FailedPrecondition
from reflow.tasks import TaskContext
from reflow.tasks.repeat import RepeatTask
from reflow.rollout.worker import RolloutWorker
from reflow.scheduler.generation.dispatch import Dispatcher
from reflow.scheduler.placement.elastic import ElasticPool
from reflow.trainer.client import TrainerStatus
from reflow.worker.service import HybridWorker, RoleStatus

from tests.unit.test_dispatch import Budget, OneWorker, StaggeredEngine


class EngineSide:
    """What HybridWorker needs of a RolloutService, on one RolloutWorker."""

    def __init__(self, worker: RolloutWorker) -> None:
        self.worker = worker

    def set_standby(self, job_id, standby, drain_timeout_s=0.0, hand_back=False):
        return self.worker.set_standby(standby, drain_timeout_s, hand_back)

    def stats(self, job_id):
        state = "standby" if self.worker.standby else self.worker.state
        return self.worker.counters, 0.0, state, ""


class Leader:
    """Trainer rank 0: a membership request takes effect two status polls later
    (the next sync boundary)."""

    def __init__(self) -> None:
        self.epoch, self.peers, self.pending, self.polls = 0, [], None, 0
        self.history: list[list[str]] = []
        self.engines: list[list[str]] = []
        self.scripted: list[tuple[int, list[str] | None]] = []  # (count, peers) as reported

    def reconfigure(self, job_id, peers, rollout_addresses=None, scripted_flips=0):
        if scripted_flips:
            self.scripted.append((scripted_flips, None if peers is None else list(peers)))
        if peers is None:
            return self.epoch
        self.pending, self.polls = list(peers), 0
        if rollout_addresses:
            self.engines.append(list(rollout_addresses))
        return self.epoch + 1

    def status(self, job_id, since_step=-1):
        self.polls += 1
        if self.pending is not None and self.polls >= 2:
            self.peers, self.pending = self.pending, None
            self.epoch += 1
            self.history.append(self.peers)
        return TrainerStatus(job_id, "running", 0, 0, group_size=1 + len(self.peers),
                             membership_epoch=self.epoch, last_regroup_s=0.01)


class RoleClient:
    def __init__(self, worker: HybridWorker) -> None:
        self.worker = worker

    def set_role(self, job_id, role, drain_timeout_s=60.0, hand_back=False):
        return self.worker.set_role(job_id, role, drain_timeout_s, hand_back)


def _spec(**cluster):
    return parse_job_spec({"model": {"path": "/m"}, "trainer": {"batch_size": 8,
                                                                "num_steps": 100},
                           "rollout": {"group_size": 2, "max_inflight_samples": 4},
                           "replay": {"max_staleness": 1}, "scheduler": {"placement": False},
                           "cluster": cluster})


def _pool_job(spec):
    """A pool of spec.cluster.workers: worker 0 the scripted leader, every other a
    HybridWorker over a real RolloutWorker (engine rank = its index)."""
    n = spec.cluster.workers
    budget, engines, clients, hybrids, sources = Budget(), {}, {}, {}, {}
    for i in range(1, n):
        engines[f"w{i}"] = StaggeredEngine(0.02)
        worker = RolloutWorker("j", spec, lambda e=engines[f"w{i}"]: e,
                               RepeatTask(8, 3, context=TaskContext(seed=i)), budget,
                               encode=lambda text: [1, 2], decode=lambda ids: "a",
                               weight_sync=(i, n, "127.0.0.1"))
        worker.start()
        clients[f"w{i}"] = OneWorker(worker)
        hybrids[i] = HybridWorker(EngineSide(worker), trainer=None)
        sources[f"w{i}"] = worker
    standby = {f"w{i}" for i in range(1, spec.cluster.trainer_workers)}  # trainers at start
    dispatcher = Dispatcher("j", spec, budget, clients, RepeatTask(8, 3, context=TaskContext(seed=1)),
                            standby=standby)
    leader, events = Leader(), []
    pool = ElasticPool("j", spec, [f"w{i}" for i in range(n)], leader, dispatcher,
                       worker_client_factory=lambda a: RoleClient(hybrids[int(a[1:])]),
                       record=events.append)
    dispatcher.start()
    pool.start_roles()
    yield pool, dispatcher, clients, sources, budget, leader, events, hybrids
    pool.stop()
    dispatcher.stop()
    for w in sources.values():
        w.stop()


@pytest.fixture(params=["return", "finish"])
def pool_job(request):
    yield from _pool_job(_spec(workers=3, trainer_workers=1, flip_inflight=request.param,
                               flips=[{"at_step": 5, "worker": 2, "role": "trainer"}]))


def _wait(predicate, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)



def test_flips_move_a_worker_both_ways_without_losing_samples(pool_job):
    pool, dispatcher, clients, sources, budget, leader, events, hybrids = pool_job
    _wait(lambda: len(clients["w2"].prompts) >= 3)  # w2 generates
    pool.schedule(step=4)
    assert pool._queue.qsize() == 0  # not yet its step
    pool.schedule(step=5)  # cluster.flips[0]: worker 2 -> trainer
    _wait(lambda: pool.flips_done == 1)
    flip = [e for e in events if e["event"] == "role_flip"][-1]
    assert (flip["worker"], flip["from"], flip["to"]) == (2, "rollout", "trainer")
    assert flip["drain_s"] >= 0 and flip["flip_s"] <= flip["total_s"]
    # Handed back whole or finished into the buffer: none left out either way.
    assert flip["samples_in_flight"] == 0
    if pool.spec.cluster.flip_inflight == "return":
        assert flip["returned_groups"] >= 1  # w2 was generating: its groups came back
    else:
        assert flip["returned_groups"] == 0 and flip["drain_s"] > 0
    assert leader.peers == ["w2"] and pool.by_role() == {"trainer": ["worker-0", "worker-2"],
                                                         "rollout": ["worker-1"]}
    assert hybrids[2].role("j").role == "trainer"
    # Every sample dispatched to w2 reached the buffer: submitted groups x group size.
    submitted = len(clients["w2"].prompts)
    assert sources["w2"].counters.inflight_samples == 0
    assert dispatcher.inflight("w2") == 0
    time.sleep(0.3)
    assert len(clients["w2"].prompts) == submitted  # never routed to while a trainer
    with pytest.raises(Exception, match="trainer role"):
        sources["w2"].submit_group("g-late", next(RepeatTask(8, 3, context=TaskContext(seed=9)).prompts()))
    before_w1 = len(clients["w1"].prompts)
    _wait(lambda: len(clients["w1"].prompts) > before_w1 + 3)  # w1 carries the job alone

    pool.request(2, "rollout")
    _wait(lambda: pool.flips_done == 2)
    back = [e for e in events if e["event"] == "role_flip"][-1]
    assert (back["from"], back["to"]) == ("trainer", "rollout") and "admit_s" in back
    assert leader.history == [["w2"], []]
    _wait(lambda: len(clients["w2"].prompts) > submitted)  # routed to again
    # Each prompt went out once across both workers and both flips, but for the
    # groups w2 handed back when it left: each of those went out once more, to w1.
    sent = clients["w1"].prompts + clients["w2"].prompts
    again = {p for p in sent if sent.count(p) > 1}
    assert len(sent) - len(set(sent)) == len(again) == flip["returned_groups"]
    assert again <= set(clients["w2"].prompts) & set(clients["w1"].prompts)


def test_scripted_flips_are_reported_to_the_leader_in_order_refused_ones_too():
    """The leader holds a sync boundary until every scripted flip due is reported
    (trainer/membership.py await_scripted_flips): a flip carried out reports its
    count with its membership; one refused (here: its worker was lost) reports its
    count alone, after the flips queued before it."""
    spec = _spec(workers=4, trainer_workers=1,
                 flips=[{"at_step": 2, "worker": 2, "role": "trainer"},
                        {"at_step": 3, "worker": 3, "role": "trainer"}])

    class Roles:
        def set_role(self, job_id, role, drain_timeout_s=60.0, hand_back=False):
            return RoleStatus(job_id, role)

        def set_sync_place(self, job_id, first_rank, world_size):
            return None

    class Routes:
        returned_groups = 0
        role_flips = __import__("collections").Counter()
        clients = {f"w{i}": Roles() for i in range(4)}

        def set_standby(self, address, standby):
            return None

        def inflight(self, address):
            return 0

        def routable(self, address):
            return True

        def worker_retired(self, address):
            return 0

    leader, events = Leader(), []
    pool = ElasticPool("j", spec, ["w0", "w1", "w2", "w3"], leader, Routes(),
                       worker_client_factory=lambda a: Roles(), record=events.append)
    pool.start_roles()
    try:
        pool.schedule(step=2)
        pool.worker_lost("worker-3", "killed")
        pool.schedule(step=3)
        _wait(lambda: len(leader.scripted) == 2)
    finally:
        pool.stop()
    assert leader.scripted == [(1, ["w2"]), (2, None)]
    assert [e["event"] for e in events if e["event"].startswith("role_flip")] == [
        "role_flip_refused", "role_flip"]


def test_a_flip_the_job_s_end_overtakes_is_dropped_not_failed():
    """The leader finished before the flip reached it and refuses the change: the
    flip is dropped (role_flip_dropped), and the pool reports no error."""
    spec = _spec(workers=3, trainer_workers=1)

    class Finished(Leader):
        def reconfigure(self, job_id, peers, rollout_addresses=None, scripted_flips=0):
            raise FailedPrecondition(f"job {job_id!r} is not training on this trainer")

        def status(self, job_id, since_step=-1):
            return TrainerStatus(job_id, "succeeded", 7, 7)

    class Roles:
        def set_role(self, job_id, role, drain_timeout_s=60.0, hand_back=False):
            return RoleStatus(job_id, role)

    class Routes:
        returned_groups = 0
        role_flips = __import__("collections").Counter()

        def set_standby(self, address, standby):
            return None

        def inflight(self, address):
            return 0

    events = []
    pool = ElasticPool("j", spec, ["w0", "w1", "w2"], Finished(), Routes(),
                       worker_client_factory=lambda a: Roles(), record=events.append)
    pool.start_roles()
    try:
        pool.request(2, "trainer")
        _wait(lambda: any(e["event"] == "role_flip_dropped" for e in events))
    finally:
        pool.stop()
    assert pool.error == "" and not [e for e in events if e["event"] == "role_flip_failed"]


def test_requests_that_would_break_the_pool_are_refused(pool_job):
    pool = pool_job[0]
    with pytest.raises(ValueError, match="worker: 0"):
        pool.request(0, "rollout")
    with pytest.raises(ValueError, match="worker: 3"):
        pool.request(3, "trainer")
    with pytest.raises(ValueError, match="role"):
        pool.request(1, "judge")
    with pytest.raises(FailedPrecondition, match="already a rollout"):
        pool.request(1, "rollout")
    pool.request(1, "trainer")
    with pytest.raises(FailedPrecondition, match="without a rollout worker"):
        pool.request(2, "trainer")


def test_a_lost_worker_leaves_the_pool_and_its_groups_go_to_the_others(pool_job):
    pool, dispatcher, clients, sources, budget, leader, events, hybrids = pool_job
    _wait(lambda: len(clients["w1"].prompts) >= 3 and dispatcher.inflight("w1") > 0)
    held = dispatcher.inflight("w1")
    event = pool.worker_lost("worker-1", "worker-1 exited (exit code -9)")
    assert event["event"] == "worker_left_pool" and event["role"] == "rollout"
    assert event["groups_rerouted"] >= 1 and held > 0
    # The survivor's engine takes rank 1 of a two-rank weight-sync group, and the
    # leader is told which engines remain, after that.
    assert (sources["w2"].sync_rank, sources["w2"].sync_world_size) == (1, 2)
    assert leader.engines == [["w2"]]
    assert pool.by_role() == {"trainer": ["worker-0"], "rollout": ["worker-2"],
                              "lost": ["worker-1"]}
    assert pool.lost_addresses == {"w1"}
    # Never routed to again; the groups it held went to w2, once each.
    sent_w1 = len(clients["w1"].prompts)
    before_w2 = len(clients["w2"].prompts)
    _wait(lambda: len(clients["w2"].prompts) > before_w2 + 3)
    assert len(clients["w1"].prompts) == sent_w1
    assert dispatcher.recovered_groups == event["groups_rerouted"]
    # A second report of the same loss changes nothing; the last rollout worker and
    # the leader cannot be lost with the job going on, nor can a lost worker flip.
    assert pool.worker_lost("worker-1", "again") is None
    with pytest.raises(FailedPrecondition, match="last rollout worker"):
        pool.worker_lost("worker-2", "exited")
    with pytest.raises(FailedPrecondition, match="trainer rank 0"):
        pool.worker_lost("worker-0", "exited")
    with pytest.raises(FailedPrecondition, match="was lost"):
        pool.request(1, "trainer")
    assert pool.by_role()["rollout"] == ["worker-2"]


def test_a_loss_below_the_configured_minimum_fails_the_job_instead():
    spec = _spec(workers=3, trainer_workers=1, min_workers=3)
    pool = ElasticPool("j", spec, ["w0", "w1", "w2"], Leader(), dispatcher=None,
                       worker_client_factory=lambda a: None, record=lambda e: None)
    with pytest.raises(FailedPrecondition, match="cluster.min_workers=3"):
        pool.worker_lost("worker-1", "exited")
    assert pool.by_role() == {"trainer": ["worker-0"], "rollout": ["worker-1", "worker-2"]}
    with pytest.raises(ValueError, match="min_workers"):
        _spec(workers=3, min_workers=4)
    with pytest.raises(ValueError, match="min_workers"):
        parse_job_spec({"model": {"path": "/m"}, "cluster": {"min_workers": 3}})


def test_a_rollout_worker_s_sync_place_falls_or_grows_after_it_never_rises():
    spec = _spec(workers=3, trainer_workers=1)
    worker = RolloutWorker("j", spec, lambda: StaggeredEngine(0.02),
                           RepeatTask(8, 3, context=TaskContext(seed=1)), Budget(),
                           encode=lambda text: [1, 2], decode=lambda ids: "a",
                           weight_sync=(2, 3, "127.0.0.1"))
    worker.set_sync_place(2, 3)  # a retry of the place it has
    with pytest.raises(ValueError, match="does not follow"):
        worker.set_sync_place(3, 4)  # a rank that rises
    with pytest.raises(ValueError, match="does not follow"):
        worker.set_sync_place(1, 3)  # an engine below it left, but the group did not shrink
    worker.set_sync_place(2, 4)  # an engine joined after it
    assert (worker.sync_rank, worker.sync_world_size) == (2, 4)
    worker.set_sync_place(2, 3)  # and was given back
    with pytest.raises(ValueError, match="rank: 0"):
        worker.set_sync_place(0, 2)
    with pytest.raises(ValueError, match="rank: 2 .* does not fit"):
        worker.set_sync_place(2, 2)
    worker.set_sync_place(1, 2)
    assert (worker.sync_rank, worker.sync_world_size) == (1, 2)


def test_cluster_spec_is_validated():
    with pytest.raises(ValueError, match="trainer_workers"):
        _spec(workers=2, trainer_workers=2)
    with pytest.raises(ValueError, match=r"flips\[0\].worker"):
        _spec(workers=2, flips=[{"at_step": 1, "worker": 2, "role": "trainer"}])
    with pytest.raises(ValueError, match="already a rollout"):
        _spec(workers=3, flips=[{"at_step": 1, "worker": 1, "role": "rollout"}])
    with pytest.raises(ValueError, match="without a rollout worker"):
        _spec(workers=2, flips=[{"at_step": 1, "worker": 1, "role": "trainer"}])
    with pytest.raises(ValueError, match="step order"):
        _spec(workers=3, trainer_workers=2, flips=[{"at_step": 5, "worker": 1, "role": "rollout"},
                                                   {"at_step": 4, "worker": 1,
                                                    "role": "trainer"}])
    with pytest.raises(ValueError, match="need cluster.workers"):
        _spec(flips=[{"at_step": 1, "worker": 1, "role": "trainer"}])
    with pytest.raises(ValueError, match="scheduler.placement: false"):
        parse_job_spec({"model": {"path": "/m"}, "trainer": {"batch_size": 8},
                        "rollout": {"group_size": 2},
                        "cluster": {"workers": 3, "flips": [{"at_step": 1, "worker": 1,
                                                             "role": "trainer"}]}})
    with pytest.raises(ValueError, match="trainer.num_steps"):
        _spec(workers=3, flips=[{"at_step": 100, "worker": 1, "role": "trainer"}])
    assert _spec(workers=3, trainer_workers=2).cluster.initial_role(1) == "trainer"


def test_a_worker_that_cannot_drain_stays_a_rollout_worker():
    class Stuck:
        def __init__(self):
            self.standby = []

        def set_standby(self, job_id, standby, drain_timeout_s=0.0, hand_back=False):
            self.standby.append(standby)
            return 4 if standby else 0

        def stats(self, job_id):
            return type("C", (), {"inflight_samples": 4})(), 0.0, "running", ""

    engine = Stuck()
    worker = HybridWorker(engine, trainer=None)
    worker.set_role("j", "rollout")
    with pytest.raises(TimeoutError, match="4 samples still generating"):
        worker.set_role("j", "trainer", drain_timeout_s=0.1)
    assert engine.standby == [False, True, False] and worker.role("j").role == "rollout"
    with pytest.raises(ValueError, match="role"):
        worker.set_role("j", "critic")


def test_a_rebalance_moves_the_highest_numbered_workers_and_waits_for_flips(pool_job):
    pool, dispatcher, clients, sources, budget, leader, events, hybrids = pool_job
    assert pool.rebalance(1, "more_trainer") == 1  # 2 rollout -> 1: worker 2 moves
    assert pool.rebalance(2, "more_rollout") == 0  # one flip at a time
    _wait(lambda: pool.flips_done == 1)
    assert pool.by_role()["trainer"] == ["worker-0", "worker-2"]
    assert pool.rebalance(2, "more_rollout") == 1
    _wait(lambda: pool.flips_done == 2)
    assert pool.by_role()["rollout"] == ["worker-1", "worker-2"]
    assert pool.rebalance(2, "more_rollout") == 0  # already there
    assert dispatcher.role_flips == {"rollout->trainer": 1, "trainer->rollout": 1}
    reasons = [e["reason"] for e in events if e["event"] == "role_flip"]
    assert reasons == ["placement: more_trainer", "placement: more_rollout"]


def test_an_elastic_spec_survives_its_own_round_trip():
    # The scheduler stores specs as JSON with every default written out.
    for cluster in ({}, {"workers": 3, "trainer_workers": 2}):
        spec = _spec(**cluster)
        again = type(spec).model_validate_json(spec.model_dump_json())
        assert again == spec


def _window(step: int, pool, per_rollout_worker: float, response_len: float) -> dict:
    """One training step's record as the trainer writes it: each trainer replica
    consumes 32 samples/s, each rollout worker produces `per_rollout_worker`."""
    roles = pool.by_role()
    rollout, trainer = len(roles["rollout"]), len(roles["trainer"])
    consumed = 32 * trainer
    return {"step": step, "step_time_s": 1.0, "generated_samples": per_rollout_worker * rollout,
            "fresh_samples": consumed, "stale_samples": 0, "replay_samples": 0,
            "rollout_idle_ratio": 0.0, "trainer_idle_ratio": 0.0, "rollout_workers": rollout,
            "trainer_workers": trainer, "response_len_mean": response_len}


def test_response_lengths_that_grow_move_workers_to_rollout_and_back(pool_job):
    """Algorithm 1 driving the pool (paper §6.2): longer responses cut each rollout
    worker's production, so the split moves toward rollout at the first step past
    the cooldown; when they shorten again it moves back. Each decision lands on
    the step's record and as an event with carried_out."""
    from reflow.scheduler.placement.planner import PlacementPlanner, PlacementPolicy
    from reflow.scheduler.placement.feed import PlacementFeed

    pool, dispatcher, clients, sources, budget, leader, events, hybrids = pool_job
    dispatcher.record = events.append  # the job's scheduling events, in one list here
    planner = PlacementPlanner(PlacementPolicy(replay_cap=0.5, cooldown_steps=3, min_gain=0.1),
                               total_workers=3)
    feed = PlacementFeed(planner, dispatcher, pool)
    records, flips = [], 0
    # (steps, samples/s per rollout worker, mean response length): short, long, short.
    phases = [(range(1, 6), 32.0, 12.0), (range(6, 12), 8.0, 48.0), (range(12, 18), 32.0, 12.0)]
    for steps, rate, length in phases:
        for step in steps:
            record = _window(step, pool, rate, length)
            feed.observe([record])
            records.append(record)
            if record["placement_carried_out"]:
                flips += 1
                _wait(lambda: pool.flips_done == flips)
    moves = [(r["step"], r["placement_reason"]) for r in records if r["placement_carried_out"]]
    # Step 1: two rollout workers out-produce one trainer (coverage 2 against 1 - σ =
    # 0.5): one worker moves to the trainer group. Responses grow at step 6, past the
    # cooldown: it moves back at once. They shorten at step 12: back to the trainer.
    assert moves == [(1, "more_trainer"), (6, "more_rollout"), (12, "more_trainer")], records
    held = {r["placement_reason"] for r in records if r["step"] in (2, 3)}
    assert held == {"cooldown"}
    assert pool.by_role() == {"trainer": ["worker-0", "worker-2"], "rollout": ["worker-1"]}
    assert dispatcher.rebalances == {"more_trainer": 2, "more_rollout": 1}
    decisions = [e for e in events if e["event"] == "placement" and e["carried_out"]]
    assert [e["reason"] for e in decisions] == ["more_trainer", "more_rollout", "more_trainer"]
    assert [e["reason"] for e in events if e["event"] == "role_flip"] == [
        "placement: more_trainer", "placement: more_rollout", "placement: more_trainer"]


def test_a_shift_inside_the_cooldown_waits_for_it(pool_job):
    from reflow.scheduler.placement.planner import PlacementPlanner, PlacementPolicy
    from reflow.scheduler.placement.feed import PlacementFeed

    pool, dispatcher, *_ = pool_job
    planner = PlacementPlanner(PlacementPolicy(replay_cap=0.5, cooldown_steps=5, min_gain=0.1),
                               total_workers=3)
    feed = PlacementFeed(planner, dispatcher, pool)
    first = _window(1, pool, 32.0, 12.0)
    feed.observe([first])
    assert first["placement_carried_out"]
    _wait(lambda: pool.flips_done == 1)
    reasons = []
    for step in range(2, 8):  # responses grow at once, at step 2
        record = _window(step, pool, 8.0, 48.0)
        feed.observe([record])
        reasons.append((record["placement_reason"], record["placement_carried_out"]))
        if record["placement_carried_out"]:
            break
    # Held for the cooldown (steps 2-5), carried out at step 6, K = 5 steps after step 1.
    assert reasons == [("cooldown", False)] * 4 + [("more_rollout", True)]


def _hsdp_spec(**cluster):
    return parse_job_spec({"model": {"path": "/m"},
                           "trainer": {"batch_size": 8, "num_steps": 100,
                                       "parallelism": "hsdp", "shard_size": 2},
                           "rollout": {"group_size": 2, "max_inflight_samples": 4},
                           "replay": {"max_staleness": 1}, "scheduler": {"placement": False},
                           "cluster": {"workers": 5, "trainer_workers": 2, **cluster}})


def test_an_hsdp_pool_moves_whole_replicas_in_one_membership_change_each():
    """trainer.parallelism hsdp, replicas of 2: Algorithm 1's moves and the spec's
    flips take a whole replica (its workers drain together, the leader gets them
    in one membership), never half of one, and one worker alone is refused."""
    jobs = _pool_job(_hsdp_spec())
    pool, dispatcher, clients, sources, budget, leader, events, hybrids = next(jobs)
    try:
        with pytest.raises(FailedPrecondition, match="whole replicas of trainer.shard_size"):
            pool.request(4, "trainer")
        assert pool.rebalance(2, "more_trainer") == 0  # one worker: half a replica
        assert pool.rebalance(1, "more_trainer") == 2  # workers 3 and 4, together
        _wait(lambda: pool.flips_done == 1)
        assert leader.history == [["w1", "w3", "w4"]]  # one membership change
        flips = [e for e in events if e["event"] == "role_flip"]
        assert [(e["worker"], e["to"], e["replica"]) for e in flips] == [
            (3, "trainer", [3, 4]), (4, "trainer", [3, 4])]
        assert {e["membership_epoch"] for e in flips} == {1}
        assert all(e["samples_in_flight"] == 0 for e in flips)
        assert [hybrids[i].role("j").role for i in (3, 4)] == ["trainer", "trainer"]
        assert pool.by_role()["rollout"] == ["worker-2"]
        assert dispatcher.role_flips["rollout->trainer"] == 2

        assert pool.rebalance(3, "more_rollout") == 2  # the last replica leaves whole
        _wait(lambda: pool.flips_done == 2)
        assert leader.history[-1] == ["w1"]
        assert pool.by_role() == {"trainer": ["worker-0", "worker-1"],
                                  "rollout": ["worker-2", "worker-3", "worker-4"]}
        before = {a: len(clients[a].prompts) for a in ("w3", "w4")}
        _wait(lambda: all(len(clients[a].prompts) > before[a] for a in before))  # routed to
    finally:
        next(jobs, None)


def test_an_hsdp_job_s_scripted_flips_come_a_replica_at_a_time():
    replica = [{"at_step": 3, "worker": 3, "role": "trainer"},
               {"at_step": 3, "worker": 4, "role": "trainer"}]
    spec = _hsdp_spec(flips=replica)
    for flips, where in [(replica[:1], r"cluster.flips\[0\]"),
                         ([replica[0], {**replica[1], "at_step": 4}], r"cluster.flips\[0\]"),
                         ([*replica, {"at_step": 5, "worker": 4, "role": "rollout"}],
                          r"cluster.flips\[2\]")]:
        with pytest.raises(ValueError, match=where + ".*2 at a time"):
            _hsdp_spec(flips=flips)
    jobs = _pool_job(spec)
    pool, dispatcher, clients, sources, budget, leader, events, hybrids = next(jobs)
    try:
        pool.schedule(step=3)
        _wait(lambda: pool.flips_done == 1)
        # One membership for both, reported to the leader as both scripted flips.
        assert leader.history == [["w1", "w3", "w4"]]
        assert leader.scripted == [(2, ["w1", "w3", "w4"])]
    finally:
        next(jobs, None)


def test_algorithm_1_moves_an_hsdp_pool_by_whole_replicas():
    from reflow.scheduler.placement.feed import planner_for

    spec = _hsdp_spec().model_copy(update={"scheduler": _hsdp_spec().scheduler.model_copy(
        update={"placement": True})})
    planner = planner_for(spec, 7)
    # Trainer counts (worker 0's rank included) are whole replicas, at least one.
    assert planner.feasible_splits() == [(1, 6), (3, 4), (5, 2)]
