"""The crash-loop budget (core/restart_budget.py): deaths count only inside the
sliding window, restarts inside it back off, and the spec names its fields."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from reflow.core.config import JobSpec
from reflow.core.restart_budget import CrashLoop, RestartBudget


def test_deaths_further_apart_than_the_window_never_add_up():
    budget = RestartBudget(max_restarts=3, window_s=600.0, backoff_s=2.0, backoff_max_s=60.0)
    times: list[float] = []
    # A preemption an hour for a week: 168 restarts, none waited for.
    for hour in range(168):
        now = hour * 3600.0
        assert budget.admit("trainer", times, now) == 0.0
        times = [*budget.recent(times, now), now]
    assert times == [167 * 3600.0]


def test_a_tight_loop_backs_off_then_fails_naming_the_crash_loop():
    budget = RestartBudget(max_restarts=3, window_s=600.0, backoff_s=2.0, backoff_max_s=5.0)
    times: list[float] = []
    waits = []
    for death in range(3):
        now = 100.0 + 10 * death
        waits.append(budget.admit("trainer", times, now))
        times.append(now)
    assert waits == [0.0, 2.0, 4.0]
    with pytest.raises(CrashLoop, match=r"crash loop: trainer died 4 times within 600 s"):
        budget.admit("trainer", times, 140.0)
    # The same deaths seen once the first has left the window: one restart is left.
    assert budget.admit("trainer", times, 100.0 + 600.0) == 4.0
    # A longer budget's backoff stops doubling at backoff_max_s.
    assert RestartBudget(5, 600.0, 2.0, 5.0).admit("trainer", times, 130.0) == 5.0
    assert budget.spent(times, 699.0) and not budget.spent(times, 700.0)


def test_zero_restarts_fails_the_first_death():
    with pytest.raises(CrashLoop, match="cluster.max_restarts=0"):
        RestartBudget(max_restarts=0, window_s=60.0).admit("replay", [], 0.0)


def test_the_spec_carries_the_window_and_refuses_a_bad_one():
    spec = JobSpec.model_validate({"model": {"path": "m"}, "cluster": {
        "max_restarts": 2, "restart_window_s": 30, "restart_backoff_s": 0}})
    assert spec.cluster.restart_budget() == RestartBudget(2, 30.0, 0.0, 60.0)
    with pytest.raises(ValidationError, match="restart_window_s"):
        JobSpec.model_validate({"model": {"path": "m"}, "cluster": {"restart_window_s": 0}})
