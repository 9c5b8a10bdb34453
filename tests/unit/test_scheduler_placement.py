"""The scheduler feeds every training step to Algorithm 1 (paper §6.2) and records
each decision: in the job's scheduling events, on the step's metrics record, and in
the recommendation counters. Carrying a rebalance out needs role flips; the
decision says it was not carried out."""

from collections import Counter

from reflow.core.config import parse_job_spec
from reflow.scheduler.placement.feed import PlacementFeed, planner_for


class Recorder:
    """The dispatcher's side of the feed: its event log, its counters, and no
    blocked time (the budget never held rollout back here)."""

    def __init__(self):
        self.events = []
        self.placement_recommendations = Counter()

    def record(self, event):
        self.events.append(event)

    def blocked_worker_seconds(self):
        return 0.0


def step(n, produced, idle_rollout=0.0, idle_trainer=0.0, workers=2):
    return {"step": n, "step_time_s": 1.0, "generated_samples": produced,
            "rollout_workers": workers, "fresh_samples": 32, "stale_samples": 0,
            "replay_samples": 32, "rollout_idle_ratio": idle_rollout,
            "trainer_idle_ratio": idle_trainer}


def planner(**scheduler):
    spec = parse_job_spec({"model": {"path": "/m"}, "scheduler": scheduler})
    return planner_for(spec, total_workers=3)  # two rollout workers, one trainer


def test_each_step_gets_a_recorded_decision():
    recorder = Recorder()
    # Target coverage 1 - σ = 0.5 of 64 samples/s consumed: 32 produced is on target.
    records = [step(1, 32), step(2, 8)]
    PlacementFeed(planner(placement_cooldown_steps=0), recorder).observe(records)
    first, second = recorder.events
    assert (first["action"], first["reason"], first["carried_out"]) == ("hold", "already_best",
                                                                        False)
    assert records[0]["placement_action"] == "hold"
    assert records[0]["placement_predicted_coverage"] == 0.5
    # 8 of 64: far too few fresh samples, and only (2, 1) -> (1, 2) would make it
    # worse; the planner keeps the most rollout it can.
    assert second["current_predicted_coverage"] == 0.125
    assert second["action"] == "hold"


def test_over_supply_recommends_more_trainers():
    recorder = Recorder()
    # 2 rollout workers make 256 samples/s for a trainer eating 64: coverage 4 vs 0.5.
    records = [step(1, 256)]
    PlacementFeed(planner(), recorder).observe(records)
    (event,) = recorder.events
    assert (event["action"], event["reason"]) == ("rebalance", "more_trainer")
    assert (event["chosen_rollout_workers"], event["chosen_trainer_workers"]) == (1, 2)
    assert event["carried_out"] is False
    assert recorder.placement_recommendations == Counter({"more_trainer": 1})


def test_placement_off_means_no_planner():
    assert planner(placement=False) is None
    assert planner(adaptive=False) is None
    spec = parse_job_spec({"model": {"path": "/m"}})
    assert planner_for(spec, total_workers=1) is None


def test_the_job_spec_sets_how_many_windows_the_capacities_pool():
    assert planner().policy.windows == 1  # the paper's one window, by default
    assert planner(placement_windows=5).policy.windows == 5
    recorder = Recorder()
    # Steps of 8 then 56 fresh samples: the last alone is over target (56/64), the two
    # pooled are on it ((8 + 56) / 2 / 64 = 0.5).
    records = [step(1, 8), step(2, 56)]
    PlacementFeed(planner(placement_windows=2, placement_cooldown_steps=0),
                  recorder).observe(records)
    assert recorder.events[-1]["pooled_windows"] == 2
    assert records[1]["placement_predicted_coverage"] == 0.5
