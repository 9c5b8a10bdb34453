"""A step cut into length-sorted micro-batches takes the same gradient as the whole batch."""

import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from reflow.core.config import parse_job_spec
from reflow.core.types import Batch, Segment, Trajectory
from reflow.trainer.loop import TrainLoop, plan_micro_batches


def test_plan_sorts_by_length_and_respects_the_budget():
    assert plan_micro_batches([10, 3, 7, 7, 2], 14) == [[0], [2, 3], [1, 4]]
    assert plan_micro_batches([10, 3, 7, 7, 2], None) == [[0, 2, 3, 1, 4]]
    # A sequence longer than the budget still trains, alone.
    assert plan_micro_batches([50, 1], 8) == [[0], [1]]
    assert plan_micro_batches([], 8) == []


@given(st.lists(st.integers(1, 300), max_size=80), st.integers(1, 2000))
def test_plan_covers_every_sequence_once_within_budget(lengths, budget):
    plan = plan_micro_batches(lengths, budget)
    assert sorted(i for mb in plan for i in mb) == list(range(len(lengths)))
    for mb in plan:
        longest = max(lengths[i] for i in mb)
        assert len(mb) == 1 or len(mb) * longest <= budget


class _Replay:
    def configure(self, job_id, config):
        pass


def _trajectories(n: int, vocab: int) -> list[Trajectory]:
    rng = random.Random(0)
    out = []
    for i in range(n):
        r = rng.choice([1, 2, 3, 5, 9, 17, 30])  # long-tailed, as the bench task's
        p = rng.randint(3, 6)
        out.append(Trajectory(
            sample_id=f"s{i}", group_id=f"g{i // 4}",
            prompt_ids=[rng.randrange(vocab) for _ in range(p)],
            response_ids=[rng.randrange(vocab) for _ in range(r)],
            logprobs=[-rng.uniform(0.5, 4.0) for _ in range(r)],
            loss_mask=[1] * r, segments=[Segment(policy_version=0, num_tokens=r)],
            advantage=rng.uniform(-1.5, 1.5), uses=rng.choice([0, 0, 1])))
    return out


def _gradient(tiny_model: str, budget: int | None, trajectories: list[Trajectory]):
    spec = parse_job_spec({"model": {"path": tiny_model},
                           "trainer": {"max_tokens_per_micro_batch": budget,
                                       "max_grad_norm": 1e6},
                           "replay": {"replay_weight": 0.5}})
    loop = TrainLoop("job", spec, _Replay(), rollouts=[], device=torch.device("cpu"))
    loop.load()
    loop.optimizer.step = lambda *a, **k: None  # keep the gradient to compare
    (stats, grad_norm), sample_stats = loop._train_step(Batch(lease_id="l", trajectories=trajectories))
    grads = {name: p.grad.clone() for name, p in loop.model.named_parameters() if p.grad is not None}
    return grads, stats, grad_norm, sample_stats


@pytest.mark.parametrize("budget", [24, 64, 200])
def test_micro_batched_step_takes_the_whole_batch_gradient(tiny_model, budget):
    trajectories = _trajectories(24, vocab=20)
    whole, whole_stats, whole_norm, whole_samples = _gradient(tiny_model, None, trajectories)
    split, split_stats, split_norm, split_samples = _gradient(tiny_model, budget, trajectories)
    assert len(plan_micro_batches([len(t.prompt_ids) + len(t.response_ids) for t in trajectories],
                                  budget)) > 1
    assert whole.keys() == split.keys() and whole
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-4, atol=1e-6, msg=name)
    assert split_norm == pytest.approx(whole_norm, rel=1e-4)
    for field in ("loss", "clip_fraction", "approx_kl", "ratio_mean"):
        assert getattr(split_stats, field) == pytest.approx(getattr(whole_stats, field),
                                                            rel=1e-4, abs=1e-6)
    for sample_id, stats in whole_samples.items():
        assert split_samples[sample_id] == pytest.approx(stats, rel=1e-4, abs=1e-6)
