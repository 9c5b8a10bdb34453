"""A step cut into length-sorted micro-batches takes the same gradient as the whole batch;
so do chunked log-probabilities and activation checkpointing; the KL penalty's
reference is the frozen initial model, on the leader and on its replicas."""

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


def _loop(tiny_model: str, **trainer) -> TrainLoop:
    spec = parse_job_spec({"model": {"path": tiny_model},
                           "trainer": {"max_grad_norm": 1e6, **trainer},
                           "replay": {"replay_weight": 0.5}})
    loop = TrainLoop("job", spec, _Replay(), rollouts=[], device=torch.device("cpu"))
    loop.load()
    return loop


def _gradient(tiny_model: str, budget: int | None, trajectories: list[Trajectory], **trainer):
    loop = _loop(tiny_model, max_tokens_per_micro_batch=budget, **trainer)
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


def _assert_same_step(got, want, rtol=1e-4, atol=1e-6):
    grads, stats, norm, samples = got
    want_grads, want_stats, want_norm, want_samples = want
    assert grads.keys() == want_grads.keys() and grads
    for name in want_grads:
        torch.testing.assert_close(grads[name], want_grads[name], rtol=rtol, atol=atol, msg=name)
    assert norm == pytest.approx(want_norm, rel=rtol)
    for field in ("loss", "clip_fraction", "approx_kl", "ratio_mean", "kl"):
        want_value = getattr(want_stats, field)
        assert getattr(stats, field) == pytest.approx(want_value, rel=rtol, abs=atol), field
    for sample_id, s in want_samples.items():
        assert samples[sample_id] == pytest.approx(s, rel=rtol, abs=atol)


@pytest.mark.parametrize("trainer", [
    {"logprob_chunk_tokens": 1},
    {"logprob_chunk_tokens": 50},
    {"logprob_chunk_tokens": 50, "activation_checkpointing": True},
])
def test_chunked_and_checkpointed_steps_take_the_full_logits_gradient(tiny_model, trainer):
    trajectories = _trajectories(24, vocab=20)
    full = _gradient(tiny_model, 64, trajectories, logprob_chunk_tokens=None)
    _assert_same_step(_gradient(tiny_model, 64, trajectories, **trainer), full,
                      rtol=1e-5, atol=1e-7)


def test_no_reference_model_without_a_kl_penalty(tiny_model):
    loop = _loop(tiny_model)
    assert loop.reference is None and loop.reference_bytes == 0


def test_the_kl_penalty_pulls_towards_the_frozen_initial_weights(tiny_model):
    loop = _loop(tiny_model, kl_coef=0.5, learning_rate=1e-2)
    ref = loop.reference
    assert ref is not None and not ref.training
    assert not any(p.requires_grad for p in ref.parameters())
    assert loop.reference_bytes == sum(p.numel() * p.element_size()
                                       for p in loop.model.parameters())
    initial = {n: p.clone() for n, p in ref.named_parameters()}
    trajectories = _trajectories(16, vocab=20)
    # Step 1: the policy is the reference, so k3 and its gradient are zero and the
    # step is the unpenalised one.
    (stats, _), _ = loop._train_step(Batch(lease_id="l", trajectories=trajectories))
    assert stats.kl == 0.0
    _assert_same_step(_gradient(tiny_model, 2048, trajectories, kl_coef=0.5),
                      _gradient(tiny_model, 2048, trajectories))
    # Step 2: the policy moved, the reference did not.
    (stats, _), _ = loop._train_step(Batch(lease_id="l", trajectories=trajectories))
    assert stats.kl > 0.0
    for name, p in ref.named_parameters():
        assert torch.equal(p, initial[name]), name
    assert not torch.equal(next(loop.model.parameters()), next(ref.parameters()))


def test_a_kl_step_without_a_reference_is_refused(tiny_model):
    from reflow.trainer.step import compute_step

    loop = _loop(tiny_model, kl_coef=0.1)
    with pytest.raises(ValueError, match="kl_coef"):
        compute_step(loop.model, loop.optimizer, loop.spec, _trajectories(2, vocab=20),
                     loop.pad_id, loop.device)


def test_replicas_build_the_reference_and_take_the_lone_trainers_kl_step(tiny_model):
    from tests.unit.test_trainer_group import _leader, _replica, _step, _wait

    spec = parse_job_spec({"model": {"path": tiny_model},
                           "trainer": {"max_grad_norm": 1e6, "kl_coef": 0.5,
                                       "learning_rate": 1e-2}})
    batches = [_trajectories(12, vocab=20) for _ in range(2)]
    alone = _leader(spec)
    want = [_step(alone, b)[0] for b in batches]
    leader, replica = _leader(spec), _replica(spec, "replica-kl:1")
    assert replica.loop.reference is not None
    leader.reconfigure(["replica-kl:1"])
    leader.apply_membership()
    _wait(lambda: replica.state == "training")
    for batch, (want_stats, want_norm) in zip(batches, want):
        stats, grad_norm = _step(leader, batch)[0]
        assert grad_norm == pytest.approx(want_norm, rel=1e-4)
        assert stats.kl == pytest.approx(want_stats.kl, rel=1e-3, abs=1e-9)
        assert stats.loss == pytest.approx(want_stats.loss, rel=1e-4, abs=1e-6)
    assert want[1][0].kl > 0.0
    _wait(lambda: replica.steps_trained == 2)
    for p, q in zip(leader.model.parameters(), replica.loop.model.parameters()):
        assert torch.equal(p, q)
    leader.group.send_command("stop", leader.step)
    _wait(lambda: replica.state == "succeeded")
