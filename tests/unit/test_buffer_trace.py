"""The buffer trace's phases, read from the replay buffer's counters."""

import pytest

from reflow.benchmarks import buffer_trace
from reflow.core.config import parse_job_spec

# b = 64, group 8, σ = 0.5 (floor 32), δ = 1: outstanding at most 128, dispatched
# less evicted at most 64 * (version + 2).
SPEC = parse_job_spec({"model": {"path": "/m"}, "mode": "reflow",
                       "rollout": {"group_size": 8}, "trainer": {"batch_size": 64}})


def _row(t, version, *, dispatched, put, trained_unused=0, evicted_unused=0, unused=0,
         replay=0, leased=0):
    return {"t": t, "policy_version": version, "dispatched_total": dispatched,
            "put_total": put, "trained_unused_total": trained_unused,
            "evicted_unused_total": evicted_unused, "unused_samples": unused,
            "replay_samples": replay, "leased_samples": leased}


def test_a_poll_is_in_the_phases_its_counters_say():
    # Trainer waits with 24 unused (< floor 32): short of fresh samples; 104 in
    # flight; outstanding 128 = the bound; 320 of 384 dispatched at version 4.
    waiting = buffer_trace.phases(_row(0, 4, dispatched=320, put=216, trained_unused=192,
                                       unused=24), SPEC)
    assert waiting["trainer_without_batch"] and not waiting["trainer_holds_batch"]
    assert waiting["short_of_fresh"] and not waiting["short_of_replay"]
    assert waiting["outstanding_bound"] and not waiting["version_bound"]
    assert not waiting["rollout_empty"]
    # The floor is met (40 unused) but 8 replay samples cannot fill 64.
    short = buffer_trace.phases(_row(0, 4, dispatched=320, put=232, trained_unused=192,
                                     unused=40, replay=8), SPEC)
    assert short["short_of_replay"] and not short["short_of_fresh"]
    # A batch is out, nothing is in flight, 64 wait unused: the engine is empty and
    # the version bound (64 * 5 = 320 dispatched) is reached.
    busy = buffer_trace.phases(_row(0, 3, dispatched=320, put=320, trained_unused=192,
                                    unused=64, leased=64), SPEC)
    assert busy["trainer_holds_batch"] and busy["rollout_empty"] and busy["version_bound"]
    assert not busy["short_of_fresh"] and not busy["short_of_replay"]


def test_shares_weigh_each_poll_by_the_time_to_the_next_and_skip_warmup():
    rows = [
        _row(0.0, 0, dispatched=128, put=0),                        # warm-up: skipped
        _row(1.0, 5, dispatched=448, put=448, unused=64, trained_unused=320),
        _row(4.0, 5, dispatched=448, put=448, leased=64, trained_unused=320),
        _row(5.0, 6, dispatched=448, put=448, trained_unused=384),   # last: no duration
    ]
    shares = buffer_trace.phase_shares(rows, SPEC, warmup_versions=5)
    assert shares["trainer_without_batch"] == pytest.approx(0.75)
    assert shares["trainer_holds_batch"] == pytest.approx(0.25)
    assert shares["rollout_empty"] == pytest.approx(1.0)
    assert shares["short_of_fresh"] == 0.0
    assert buffer_trace.phase_shares(rows[:1], SPEC, warmup_versions=0) == dict.fromkeys(
        buffer_trace.PHASES, 0.0)
