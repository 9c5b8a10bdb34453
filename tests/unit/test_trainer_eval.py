"""The trainer side of periodic evaluation (when it runs, where the result
goes), and the guard that keeps a non-finite gradient out of the weights."""

import math
import threading

import torch

from reflow.core.config import parse_job_spec
from reflow.core.errors import FailedPrecondition
from reflow.core.types import Batch
from reflow.rollout.evaluation import EvalResult
from reflow.trainer.evaluation import PeriodicEval
from tests.unit.test_micro_batches import _loop, _trajectories


class Rollout:
    def __init__(self, standby=False, gate=None):
        self.standby, self.gate, self.calls = standby, gate, []

    def evaluate(self, job_id, num_prompts, greedy, deadline_s):
        self.calls.append((num_prompts, greedy))
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
