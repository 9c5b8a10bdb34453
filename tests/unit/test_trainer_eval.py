"""The trainer side of periodic evaluation (when it runs, where the result
goes), and the guard that keeps a non-finite gradient out of the weights."""

import math
import threading
from dataclasses import replace

import pytest
import torch

from reflow.core.config import parse_job_spec
from reflow.core.errors import FailedPrecondition
from reflow.core.types import Batch
from reflow.rollout.eval_metrics import PromptOutcome
from reflow.rollout.evaluation import EvalResult
from reflow.trainer.evaluation import PeriodicEval
from tests.unit.test_micro_batches import _loop, _trajectories


class Rollout:
    def __init__(self, standby=False, gate=None):
        self.standby, self.gate, self.calls = standby, gate, []

    def evaluate(self, job_id, plan, deadline_s):
        num_prompts = plan.num_prompts
        self.calls.append((num_prompts, plan.greedy))
        if self.standby:
            raise FailedPrecondition("rollout worker stands by")
        if self.gate is not None:
            self.gate.wait(10)
        return EvalResult(0.25, num_prompts, 0, len(self.calls) - 1, 0.1)


def _spec(interval):
    return parse_job_spec({"model": {"path": "/m"},
                           "eval": {"interval": interval, "num_prompts": 8}})


def test_evaluations_run_every_interval_on_a_generating_worker():
    standby, generating = Rollout(standby=True), Rollout()
    evals = PeriodicEval("j", _spec(2), [standby, generating])
    for version in range(5):
        evals.maybe_start(version)
        fields = evals.take(wait_s=5)
        assert bool(fields) == (version % 2 == 0)
    assert generating.calls == [(8, True)] * 3 and len(standby.calls) == 3
    assert evals.take() == {}  # each result is taken once
    evals.close()


def test_an_evaluation_still_running_is_not_queued_behind():
    gate = threading.Event()
    rollout = Rollout(gate=gate)
    evals = PeriodicEval("j", _spec(1), [rollout])
    evals.maybe_start(0)
    evals.maybe_start(1)  # v0's is still running: v1's is skipped
    assert evals.take() == {}
    gate.set()
    fields = evals.take(wait_s=5)
    assert fields["eval_reward"] == 0.25 and fields["eval_policy_version"] == 0
    assert len(rollout.calls) == 1
    evals.close()


class KSamples(Rollout):
    """Three prompts, four samples each: 2, 0 and 4 correct; the vote right on the first."""

    def evaluate(self, job_id, plan, deadline_s):
        self.calls.append(plan)
        prompts = (PromptOutcome(4, 2, 2.0, 0, True), PromptOutcome(3, 0, 0.6, 1, False),
                   PromptOutcome(4, 4, 4.0, 0, False))
        return EvalResult(6.6 / 11, 11, 1, 0, 0.1, k=plan.k, prompts=prompts, voted=True)


def test_a_record_carries_pass_avg_and_maj_at_k():
    spec = parse_job_spec({"model": {"path": "/m"}, "eval": {
        "interval": 1, "num_prompts": 3, "k": 4, "pass_k": [2], "correct_threshold": 0.5}})
    rollout = KSamples()
    evals = PeriodicEval("j", spec, [rollout])
    evals.maybe_start(0)
    fields = evals.take(wait_s=5)
    evals.close()
    plan = rollout.calls[0]
    assert (plan.k, plan.greedy, plan.correct_threshold, plan.temperature) == (4, False, 0.5, 0)
    assert fields["eval_k"] == 4 and fields["eval_reward"] == 6.6 / 11
    assert fields["eval_pass_at_1"] == pytest.approx((2 / 4 + 0 + 1) / 3)
    assert fields["eval_pass_at_2"] == pytest.approx((1 - 1 / 6 + 0 + 1) / 3)
    assert fields["eval_pass_at_k"] == pytest.approx(2 / 3)
    assert fields["eval_avg_at_k"] == pytest.approx((0.5 + 0.2 + 1.0) / 3)
    assert fields["eval_maj_at_k"] == pytest.approx(1 / 3)


def test_a_task_without_answers_gets_no_maj_at_k():
    rollout = Rollout()  # a result without per-prompt counts: the fields before k
    evals = PeriodicEval("j", _spec(1), [rollout])
    evals.maybe_start(0)
    fields = evals.take(wait_s=5)
    evals.close()
    assert "eval_pass_at_1" not in fields and "eval_maj_at_k" not in fields

    class NoVote(KSamples):
        def evaluate(self, job_id, plan, deadline_s):
            return replace(super().evaluate(job_id, plan, deadline_s), voted=False)

    evals = PeriodicEval("j", _spec(1), [NoVote()])
    evals.maybe_start(0)
    fields = evals.take(wait_s=5)
    evals.close()
    assert fields["eval_pass_at_1"] == pytest.approx(0.5) and "eval_maj_at_k" not in fields


def test_without_an_interval_nothing_is_evaluated():
    rollout = Rollout()
    evals = PeriodicEval("j", _spec(0), [rollout])
    evals.maybe_start(0)
    assert evals.take(wait_s=0.1) == {} and rollout.calls == []


def test_a_non_finite_gradient_leaves_the_weights_as_they_were(tiny_model):
    loop = _loop(tiny_model)
    before = {n: p.detach().clone() for n, p in loop.model.named_parameters()}
    trajectories = _trajectories(8, 40)
    trajectories[3].advantage = math.nan
    (stats, grad_norm), _ = loop._train_step(Batch(lease_id="l", trajectories=trajectories))
    assert not math.isfinite(grad_norm)
    for name, p in loop.model.named_parameters():
        assert torch.equal(p, before[name]), name
    # The next, finite step moves them again.
    trajectories[3].advantage = 0.5
    loop._train_step(Batch(lease_id="l", trajectories=trajectories))
    assert any(not torch.equal(p, before[n]) for n, p in loop.model.named_parameters())


def test_the_latest_evaluation_s_scores_are_gauges_and_maj_at_k_only_where_a_task_votes():
    from reflow.trainer.metrics import TrainerMetrics

    base = {"step_time_s": 1.0, "trained_tokens": 10, "trainer_tokens_per_s": 10.0,
            "trainer_idle_ratio": 0.0, "rollout_idle_ratio": 0.0, "policy_version": 2,
            "weight_sync_s": 0.0, "reward_mean": 0.5, "replay_fraction": 0.0,
            "max_staleness": 0}
    metrics = TrainerMetrics()
    metrics.observe("j", {**base, "eval_reward": 0.25, "eval_policy_version": 2,
                          "eval_pass_at_1": 0.25, "eval_pass_at_k": 0.5, "eval_maj_at_k": 0.375})
    metrics.observe("k", {**base, "eval_reward": 0.1, "eval_policy_version": 2,
                          "eval_pass_at_1": 0.1, "eval_pass_at_k": 0.3})
    registry = metrics.registry

    def score(job, metric):
        return registry.get_sample_value("reflow_trainer_eval_score_ratio",
                                         {"job_id": job, "metric": metric})

    assert (score("j", "pass_at_1"), score("j", "pass_at_k"), score("j", "maj_at_k")) == \
        (0.25, 0.5, 0.375)
    assert score("k", "pass_at_k") == 0.3 and score("k", "maj_at_k") is None
