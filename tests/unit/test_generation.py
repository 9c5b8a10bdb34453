"""Adaptive generation scheduling (paper §6.1), table-driven: the concurrency
controller's slow loop, the response-length estimate T̂(r), and token-budget
admission with least-loaded routing."""

import pytest

from reflow.core.config import parse_job_spec
from reflow.scheduler.generation.concurrency import (ConcurrencyController, LengthEstimator, WorkerLoad,
                                         route)


def controller(**overrides):
    values = dict(alpha=0.5, min_cap=8, max_cap=64, step=8, backoff=0.75, utilisation_low=0.8,
                  utilisation_high=0.95, preemption_tolerance=0.5)
    values.update(overrides)
    return ConcurrencyController(**values)


# cap, limited, [(utilisation, preemptions) per tick], caps after each tick, reasons
CONTROL_CASES = {
    "idle cache, cap binding: raise by step": (
        16, True, [(0.1, 0)], [24], ["raise_under_utilised"]),
    "idle cache, cap not binding: hold": (
        16, False, [(0.1, 0)], [16], ["hold"]),
    "raise stops at max": (
        60, True, [(0.1, 0)], [64], ["raise_under_utilised"]),
    "at max: hold": (
        64, True, [(0.1, 0)], [64], ["hold"]),
    "preemptions cut multiplicatively": (
        32, True, [(0.5, 4)], [24], ["cut_preemption"]),
    "cut stops at min": (
        9, False, [(0.5, 4)], [8], ["cut_preemption"]),
    "nearly full cache cuts": (
        32, True, [(0.99, 0)], [24], ["cut_kv_pressure"]),
    "between the thresholds: hold": (
        32, True, [(0.9, 0)], [32], ["hold"]),
    # EWMA α = 0.5: one preemption burst (4 → ΔP̂ 4, 2, 1, 0.5) keeps cutting until
    # the smoothed rate falls to the tolerance, then the idle cache raises again.
    "a burst decays through the EWMA": (
        64, True, [(0.1, 4), (0.1, 0), (0.1, 0), (0.1, 0)], [48, 36, 27, 35],
        ["cut_preemption", "cut_preemption", "cut_preemption", "raise_under_utilised"]),
    # û smooths u: a single high reading after a low one does not cut.
    "one high utilisation reading is smoothed away": (
        32, False, [(0.5, 0), (1.0, 0)], [32, 32], ["hold", "hold"]),
}


@pytest.mark.parametrize("cap,limited,ticks,caps,reasons", CONTROL_CASES.values(),
                         ids=CONTROL_CASES.keys())
def test_concurrency_controller(cap, limited, ticks, caps, reasons):
    ctl = controller()
    worker = WorkerLoad("w", cap)
    got_caps, got_reasons = [], []
    for utilisation, preemptions in ticks:
        worker.cap_limited = limited
        decision = ctl.update(worker, utilisation, preemptions)
        assert decision.old_cap == (got_caps[-1] if got_caps else cap)
        got_caps.append(worker.cap)
        got_reasons.append(decision.reason)
    assert got_caps == caps
    assert got_reasons == reasons
    assert worker.cap_limited is False  # evidence is per tick


def test_controller_defaults_come_from_the_spec():
    spec = parse_job_spec({"model": {"path": "/m"}, "rollout": {"group_size": 4},
                           "trainer": {"batch_size": 8},
                           "scheduler": {"max_concurrency": 100, "concurrency_backoff": 0.5}})
    ctl = ConcurrencyController.from_spec(spec)
    assert (ctl.min_cap, ctl.max_cap, ctl.step, ctl.backoff) == (4, 100, 4, 0.5)


def test_length_estimate_is_per_prompt_where_seen_else_the_job_s():
    est = LengthEstimator(max_tokens=64, alpha=0.5)
    assert est.predict("a") == 64  # nothing seen: the safe side
    est.observe("a", 10)
    assert est.predict("a") == 10 and est.predict("b") == 10
    est.observe("b", 30)
    assert est.predict("a") == 10  # its own history
    assert est.predict("b") == 30
    assert est.predict("c") == 20  # the job-wide EWMA: 0.5·30 + 0.5·10
    est.observe("a", 1000)  # clipped at max_tokens
    assert est.predict("a") == 37


def test_length_history_is_bounded():
    est = LengthEstimator(max_tokens=64, max_prompts=2)
    for key, n in (("a", 1), ("b", 2), ("c", 3)):
        est.observe(key, n)
    assert est.predict("a") == est.predict("zzz")  # forgotten: falls back to the job's


def loads(*specs):
    return [WorkerLoad(name, cap, inflight, tokens, budget)
            for name, cap, inflight, tokens, budget in specs]


# workers (name, cap, inflight, predicted tokens, KV budget), group tokens,
# token admission on, chosen worker, refused_by
ROUTE_CASES = {
    "least token load wins": (
        [("a", 16, 8, 600, 1000), ("b", 16, 8, 200, 1000)], 100, True, "b", ""),
    "a full cap is skipped": (
        [("a", 16, 16, 0, 1000), ("b", 16, 8, 800, 1000)], 50, True, "b", ""),
    "over ρ·budget is refused": (
        [("a", 16, 4, 850, 1000)], 100, True, None, "tokens"),
    "token admission off ignores the budget": (
        [("a", 16, 4, 850, 1000)], 100, False, "a", ""),
    "an empty worker takes any one group": (
        [("a", 16, 0, 0, 1000)], 5000, True, "a", ""),
    "unknown budget: slots only, fewest in flight": (
        [("a", 16, 8, 0, 0), ("b", 16, 4, 0, 0)], 100, True, "b", ""),
    "every cap full": (
        [("a", 8, 8, 0, 1000), ("b", 8, 6, 0, 1000)], 10, True, None, "cap"),
}


@pytest.mark.parametrize("workers,group_tokens,admission,chosen,refused_by",
                         ROUTE_CASES.values(), ids=ROUTE_CASES.keys())
def test_route(workers, group_tokens, admission, chosen, refused_by):
    pool = loads(*workers)
    result = route(pool, 4, group_tokens, 0.9, admission)
    assert (result.worker.name if result.worker else None) == chosen
    assert result.refused_by == refused_by
    # Only a group that no worker took is evidence that a cap binds.
    assert [w.cap_limited for w in pool] == [
        refused_by == "cap" and w.inflight + 4 > w.cap for w in pool]
