"""Algorithm 1's blocked ratio (paper §6.2): the dispatcher integrates the time
routable workers stood empty because the buffer's budget granted nothing more,
on its clock, and the
placement feed turns it (with the step's weight sync) into each window's
rollout_blocked_ratio, so a budget-bound rollout is not read as a slow one."""

from reflow.core.clock import VirtualClock
from reflow.core.config import parse_job_spec
from reflow.scheduler.generation.dispatch import Dispatcher
from reflow.scheduler.placement.planner import PlacementPlanner, PlacementPolicy
from reflow.scheduler.placement.feed import PlacementFeed
from reflow.tasks import TaskContext
from reflow.tasks.repeat import RepeatTask

from tests.unit.test_dispatch import Budget

SPEC = parse_job_spec({"model": {"path": "/m"}, "trainer": {"batch_size": 8},
                       "rollout": {"group_size": 2, "max_inflight_samples": 8},
                       "scheduler": {"concurrency_control": False}})


class Engine:
    """A worker that takes every group and never finishes one."""

    def __init__(self) -> None:
        self.groups = 0

    def submit_group(self, job_id, group_id, prompt, concurrency_cap=0, bounds=None):
        self.groups += 1

    def stats(self, job_id):
        return type("Stats", (), {"state": "running", "kv_cache_tokens": 10**6})()


def _dispatcher(limit: int) -> tuple[Dispatcher, VirtualClock, dict]:
    clock = VirtualClock()
    engines = {"w1": Engine(), "w2": Engine()}
    task = RepeatTask(8, 3, context=TaskContext(seed=0))
    return Dispatcher("j", SPEC, Budget(limit), engines, task, clock=clock), clock, engines


def test_a_worker_the_budget_leaves_empty_counts_as_blocked_one_generating_does_not():
    # Two workers with caps of 8; the budget grants one group of 2, then refuses.
    dispatcher, clock, engines = _dispatcher(limit=2)
    dispatcher.dispatch_round()
    assert sorted(e.groups for e in engines.values()) == [0, 1]
    clock.advance_to(10.0)
    # 10 s: the empty worker is blocked; the other, 2 of 8, generates (not blocked).
    assert abs(dispatcher.blocked_worker_seconds() - 10.0) < 1e-9
    dispatcher.dispatch_round()  # refused again: the segment goes on at the same rate
    clock.advance_to(12.0)
    assert abs(dispatcher.blocked_worker_seconds() - 12.0) < 1e-9


def test_a_budget_that_grants_everything_blocks_nothing():
    dispatcher, clock, _ = _dispatcher(limit=10**9)
    dispatcher.dispatch_round()
    clock.advance_to(10.0)
    dispatcher.dispatch_round()
    assert dispatcher.blocked_worker_seconds() == 0.0


def _record(step: int, sync_s: float = 0.0) -> dict:
    # 2 rollout workers produce 8 samples in 4 s; 2 trainers consume 16 (2 a second each).
    return {"step": step, "step_time_s": 4.0, "generated_samples": 8, "fresh_samples": 16,
            "stale_samples": 0, "replay_samples": 0, "trainer_idle_ratio": 0.0,
            "rollout_workers": 2, "trainer_workers": 2, "weight_sync_s": sync_s}


def _feed(limit: int) -> tuple[PlacementFeed, VirtualClock]:
    dispatcher, clock, _ = _dispatcher(limit)
    planner = PlacementPlanner(PlacementPolicy(replay_cap=0.5, cooldown_steps=0, min_gain=0.1),
                               total_workers=4)
    feed = PlacementFeed(planner, dispatcher)
    dispatcher.dispatch_round()
    return feed, clock


def test_a_budget_bound_rollout_is_not_read_as_a_slow_one():
    """The same production, 1 sample/s a worker, is the whole capacity of a rollout
    that was never held back (coverage 2 x 1 / (2 x 2) = 1 - σ: the split is right)
    but half of one the budget held back half the time: 2 samples/s a worker,
    rollout is over-provisioned and a worker moves to the trainer."""
    unblocked, clock = _feed(limit=10**9)
    clock.advance_to(4.0)
    free = _record(1)
    unblocked.observe([free])
    assert free["rollout_blocked_ratio"] == 0.0
    assert (free["placement_action"], free["placement_reason"]) == ("hold", "already_best")

    blocked, clock = _feed(limit=2)  # one of two workers empty from here on: 0.5 blocked
    clock.advance_to(4.0)
    held = _record(1)
    blocked.observe([held])
    assert abs(held["rollout_blocked_ratio"] - 0.5) < 1e-9
    assert (held["placement_action"], held["placement_reason"]) == ("rebalance", "more_trainer")


def test_steps_of_one_poll_share_the_blocked_time_and_a_sync_blocks_every_engine():
    feed, clock = _feed(limit=2)
    clock.advance_to(8.0)
    first, second = _record(1), _record(2, sync_s=1.0)
    feed.observe([first, second])
    assert abs(first["rollout_blocked_ratio"] - 0.5) < 1e-9
    # 0.5 + the sync: 2 engines x 1 s of 8 worker-seconds.
    assert abs(second["rollout_blocked_ratio"] - 0.75) < 1e-9
    clock.advance_to(12.0)
    third = _record(3)
    feed.observe([third])  # only the blocked time since the last poll
    assert abs(third["rollout_blocked_ratio"] - 0.5) < 1e-9
