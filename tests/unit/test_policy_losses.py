"""The policy-loss plug-ins and aggregation modes against hand-worked numbers
(and verl's formulas), the off-policy correction stage, and a step's gradient
unchanged by how it is cut into micro-batches, for every loss and mode."""

import math

import pytest
import torch

from reflow.algorithms.correction import (OffPolicyTally, UpdateClock, importance_weights,
                                          proximal_logprobs, sample_slices)
from reflow.algorithms.losses import (CISPOLoss, ClipRange, DAPOLoss, Denominators, DrGRPOLoss,
                                      GRPOLoss, GSPOLoss, aggregate)
from reflow.core.algorithm_config import AlgorithmConfig
from reflow.core.config import JobSpecError, parse_job_spec
from reflow.core.types import Batch
from reflow.trainer.loop import TrainLoop
from reflow.trainer.loss import policy_loss
from tests.unit.test_micro_batches import _Replay, _trajectories

L = math.log
# Two samples, two tokens each; the second sample's second token is padding.
NEW = torch.tensor([[L(0.5), L(0.25)], [L(0.1), L(0.3)]])
OLD = torch.tensor([[L(0.25), L(0.25)], [L(0.2), 0.0]])
ADV = torch.tensor([1.0, -1.0])
MASK = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
# Ratios: sample 0 -> [2.0, 1.0]; sample 1 -> [0.5].
BATCH = Denominators(tokens=3.0, sequences=2.0, constant=4.0)


def _loss(loss, aggregation="token_mean", clip=ClipRange(0.2, 0.2), new=NEW, **kw):
    total, zeroed = policy_loss(loss, new, OLD, ADV, MASK, clip, aggregation, BATCH, **kw)
    return total, zeroed


def test_grpo_clips_both_sides_and_counts_only_the_clips_that_zero_a_gradient():
    total, zeroed = _loss(GRPOLoss())
    # A=+1: min(2, 1.2) = 1.2 and 1; A=-1: the pessimistic side, -0.8. Token mean of 3.
    assert total.item() == pytest.approx(-(1.2 + 1.0 - 0.8) / 3)
    assert zeroed.tolist() == [[True, False], [True, False]]
    # A ratio outside the band on the advantage's other side still trains (not counted).
    _, zeroed = _loss(GRPOLoss(), new=torch.tensor([[L(0.1), L(0.25)], [L(0.9), L(0.3)]]))
    assert not zeroed.any()


def test_dapo_raises_the_upper_clip():
    assert DAPOLoss.default_clip_high == 0.28
    total, _ = _loss(DAPOLoss(), clip=ClipRange(0.2, 0.28))
    assert total.item() == pytest.approx(-(1.28 + 1.0 - 0.8) / 3)


def test_aggregation_modes_by_hand():
    terms = torch.tensor([[-1.2, -1.0], [0.8, 5.0]])  # the padding term never counts
    assert aggregate(terms, MASK, "token_mean", BATCH).item() == pytest.approx(-1.4 / 3)
    # Sequence means (-1.1, 0.8), averaged over the two sequences.
    assert aggregate(terms, MASK, "seq_mean_token_mean", BATCH).item() == pytest.approx(-0.15)
    # Dr. GRPO: token sums over the constant 4, (-0.55, 0.2), averaged.
    assert aggregate(terms, MASK, "seq_mean_token_sum_norm", BATCH).item() == \
        pytest.approx(-0.175)
    total, _ = _loss(DrGRPOLoss(), DrGRPOLoss.default_aggregation)
    assert total.item() == pytest.approx(-0.175)


def test_a_sequence_without_loss_tokens_adds_nothing():
    terms = torch.tensor([[-1.0, -1.0], [7.0, 7.0]])
    mask = torch.tensor([[1.0, 1.0], [0.0, 0.0]])
    for mode in ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum_norm"):
        value = aggregate(terms, mask, mode, Denominators(2.0, 1.0, 2.0)).item()
        assert value == pytest.approx(-1.0), mode


def _verl_gspo(log_prob, old_log_prob, advantages, mask, low, high):
    """verl's compute_policy_loss_gspo, written out (seq-mean-token-mean)."""
    neg_kl = log_prob - old_log_prob
    seq_kl = (neg_kl * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    log_ratio = log_prob - log_prob.detach() + seq_kl.detach().unsqueeze(-1)
    ratio = torch.exp(log_ratio.clamp(max=10.0))
    losses = torch.maximum(-advantages.unsqueeze(-1) * ratio,
                           -advantages.unsqueeze(-1) * ratio.clamp(1 - low, 1 + high))
    per_seq = (losses * mask).sum(-1) / mask.sum(-1).clamp(min=1)
    return per_seq.mean()


def test_gspo_takes_one_ratio_per_sequence_as_verl_does():
    # Sequence 0's geometric-mean ratio is sqrt(2): clipped at 1.2 as a whole.
    total, zeroed = _loss(GSPOLoss(), "seq_mean_token_mean")
    assert total.item() == pytest.approx((-1.2 + 0.8) / 2)
    assert zeroed.tolist() == [[True, True], [True, True]]
    # Inside the band the gradient is the sequence ratio times each token's own.
    new = torch.tensor([[L(0.26), L(0.24)], [L(0.21), L(0.3)]], requires_grad=True)
    ours, _ = _loss(GSPOLoss(), "seq_mean_token_mean", ClipRange(3e-2, 4e-2), new=new)
    ours.backward()
    ours_grad = new.grad.clone()
    new.grad = None
    theirs = _verl_gspo(new, OLD, ADV, MASK, 3e-2, 4e-2)
    theirs.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-6)
    torch.testing.assert_close(ours_grad, new.grad)
    s0 = math.sqrt(0.26 / 0.25 * 0.24 / 0.25)
    assert ours_grad[0, 0].item() == pytest.approx(-s0 / 2 / 2, rel=1e-5)


def test_cispo_weights_every_token_and_zeroes_none():
    new = NEW.clone().requires_grad_(True)
    total, zeroed = _loss(CISPOLoss(), clip=ClipRange(0.2, 0.28), new=new)
    # Weights min(r, 1.28): 1.28, 1.0 (A=+1) and 0.5 (A=-1: no lower bound), each
    # times -A·log π.
    expected = -(1.28 * L(0.5) + 1.0 * L(0.25) - 0.5 * L(0.1)) / 3
    assert total.item() == pytest.approx(expected, rel=1e-6)
    assert not zeroed.any()
    total.backward()
    assert new.grad[0].tolist() == pytest.approx([-1.28 / 3, -1.0 / 3])
    assert new.grad[1, 0].item() == pytest.approx(0.5 / 3)


def test_importance_weights_per_token_sequence_and_geometric_mean():
    prox = torch.tensor([[L(0.5), L(0.8)]])
    behaviour = torch.tensor([[L(0.25), L(0.2)]])  # token ratios 2 and 4
    mask = torch.ones(1, 2)

    def weights(**kw):
        config = AlgorithmConfig(proximal="recompute", **kw)
        return importance_weights(config, prox, behaviour, mask)

    assert weights(importance_mode="raw")[0][0].tolist() == pytest.approx([2.0, 4.0])
    assert weights(importance_mode="truncate", importance_cap=3.0)[0][0].tolist() == \
        pytest.approx([2.0, 3.0])
    masked, outside = weights(importance_mode="mask", importance_cap=3.0)
    assert masked[0].tolist() == pytest.approx([2.0, 0.0]) and outside.tolist() == [[False, True]]
    assert weights(importance_mode="raw", importance_level="sequence")[0][0].tolist() == \
        pytest.approx([8.0, 8.0])
    geometric = weights(importance_mode="truncate", importance_level="geometric",
                        importance_cap=10.0)[0]
    assert geometric[0].tolist() == pytest.approx([math.sqrt(8.0)] * 2)
    # Sequence-level masking drops the whole sequence (8 > 3), and the floor is 1/C.
    masked, _ = weights(importance_mode="mask", importance_level="sequence", importance_cap=3.0)
    assert masked.tolist() == [[0.0, 0.0]]
    assert AlgorithmConfig(proximal="recompute", importance_mode="mask",
                           importance_cap=4.0).importance_bounds == (0.25, 4.0)
    assert importance_weights(AlgorithmConfig(), prox, behaviour, mask) == (None, None)


def test_proximal_policies():
    new = torch.tensor([[-1.0, -1.0, -1.0]], requires_grad=True)
    behaviour = torch.tensor([[-2.0, -2.0, -2.0]])
    assert proximal_logprobs(AlgorithmConfig(), new, behaviour) is behaviour
    recompute = proximal_logprobs(AlgorithmConfig(proximal="recompute"), new, behaviour)
    assert recompute.tolist() == [[-1.0] * 3] and not recompute.requires_grad
    # Interpolated: u_prox 4, u_θ 6, two updates a version. A token of version 0 (u_b 0)
    # lies 4/6 of the way to π_θ; one of version 1 (u_b 2) 2/4; one of version 3 (u_b 6,
    # the weights being trained) is π_θ itself.
    clock = UpdateClock(proximal=4, current=6, per_version=2)
    interpolated = proximal_logprobs(AlgorithmConfig(proximal="interpolate"), new, behaviour,
                                     versions=torch.tensor([[0.0, 1.0, 3.0]]), clock=clock)
    assert interpolated[0].tolist() == pytest.approx([-2 + 4 / 6, -1.5, -1.0])


def test_the_tally_reports_per_slice_mismatch_and_effective_sample_size():
    assert sample_slices([0, 2, 0, 1], [0, 0, 1, 3]).tolist() == [0, 1, 2, 2]
    tally = OffPolicyTally()
    new = torch.tensor([[L(0.5), L(0.1)], [L(0.3), L(0.3)]])
    behaviour = torch.tensor([[L(0.25), L(0.2)], [L(0.3), L(0.3)]])  # ρ = 2, 0.5; 1, 1
    mask = torch.ones(2, 2)
    tally.add(torch.tensor([2, 0]), mask, new, behaviour, torch.tensor([[1, 0], [0, 0]]), None,
              torch.full((2, 2), 0.7))
    m = tally.metrics()
    k3 = [(2 - 1) - L(2), (0.5 - 1) - L(0.5)]
    assert m["replayed_mismatch_kl"] == pytest.approx(sum(k3) / 2)
    assert m["fresh_mismatch_kl"] == pytest.approx(0.0)
    assert m["replayed_importance_ess"] == pytest.approx(2.5 ** 2 / (2 * 4.25))
    assert m["fresh_importance_ess"] == pytest.approx(1.0)
    assert m["clip_fraction"] == pytest.approx(0.25)
    assert m["replayed_clip_fraction"] == pytest.approx(0.5)
    assert m["entropy"] == pytest.approx(0.7)
    assert "stale_mismatch_kl" not in m  # no stale sample in this batch


# --- the configuration ------------------------------------------------------------------


def _spec(**sections):
    return parse_job_spec({"model": {"path": "m"}, **sections})


@pytest.mark.parametrize("name", ["os:system", "reflow.trainer.loss:GRPOLoss", "nope"])
def test_a_loss_is_a_registered_name_only(name):
    with pytest.raises(JobSpecError, match="algorithm.loss"):
        _spec(algorithm={"loss": name})


def test_contradictory_corrections_are_refused_naming_the_field():
    with pytest.raises(JobSpecError, match="algorithm.importance_mode"):
        _spec(algorithm={"importance_mode": "truncate"})
    with pytest.raises(JobSpecError, match="algorithm.proximal: interpolate"):
        _spec(algorithm={"proximal": "interpolate"})
    with pytest.raises(JobSpecError, match="trainer.num_minibatches"):
        _spec(trainer={"batch_size": 64, "num_minibatches": 3})
    with pytest.raises(JobSpecError, match="algorithm.importance_floor"):
        _spec(algorithm={"proximal": "recompute", "importance_mode": "truncate",
                         "importance_floor": 0.5})
    spec = _spec(algorithm={"loss": "dr_grpo"})
    assert spec.algorithm.advantage_name == "mean_centered"


# --- a whole step: micro-batching changes nothing, for every loss and mode -------------


def _step(tiny_model, budget, trajectories, algorithm, num_minibatches=1, keep_step=False):
    spec = parse_job_spec({"model": {"path": tiny_model},
                           "trainer": {"max_grad_norm": 1e6, "max_tokens_per_micro_batch": budget,
                                       "batch_size": 24, "num_minibatches": num_minibatches},
                           "rollout": {"group_size": 4},
                           "replay": {"replay_weight": 0.5}, "algorithm": algorithm})
    loop = TrainLoop("job", spec, _Replay(), rollouts=[], device=torch.device("cpu"))
    loop.load()
    if not keep_step:
        loop.optimizer.step = lambda *a, **k: None  # keep the gradient to compare
    (stats, norm), _ = loop._train_step(Batch(lease_id="l", trajectories=trajectories))
    grads = {n: p.grad.clone() for n, p in loop.model.named_parameters() if p.grad is not None}
    return grads, stats, norm, loop


ALGORITHMS = [
    {"loss": "dapo"},
    {"loss": "dr_grpo"},
    {"loss": "gspo"},
    {"loss": "cispo"},
    {"loss_aggregation": "seq_mean_token_mean"},
    {"proximal": "recompute", "importance_mode": "truncate"},
    {"proximal": "recompute", "importance_mode": "mask", "importance_level": "sequence",
     "importance_cap": 50.0},
]


@pytest.mark.parametrize("algorithm", ALGORITHMS, ids=lambda a: ",".join(map(str, a.values())))
def test_every_loss_and_mode_takes_the_whole_batch_gradient_in_micro_batches(tiny_model,
                                                                             algorithm):
    trajectories = _trajectories(24, vocab=20)
    whole = _step(tiny_model, None, trajectories, algorithm)
    split = _step(tiny_model, 24, trajectories, algorithm)
    assert whole[0].keys() == split[0].keys() and whole[0]
    for name in whole[0]:
        torch.testing.assert_close(split[0][name], whole[0][name], rtol=1e-4, atol=1e-6,
                                   msg=name)
    for field in ("loss", "clip_fraction", "approx_kl", "ratio_mean"):
        assert getattr(split[1], field) == pytest.approx(getattr(whole[1], field),
                                                         rel=1e-4, abs=1e-6)
    assert split[1].offpolicy == pytest.approx(whole[1].offpolicy, rel=1e-4, abs=1e-6)


def test_the_recomputed_proximal_keeps_every_behaviour_mismatch_token_in_the_gradient(tiny_model):
    # The behaviour log-probs are far from the model's: clipped against them most
    # tokens lose their gradient; against the recomputed proximal none do.
    trajectories = _trajectories(24, vocab=20)
    _, behaviour, _, _ = _step(tiny_model, None, trajectories, {})
    _, recompute, _, _ = _step(tiny_model, None, trajectories,
                               {"proximal": "recompute", "importance_mode": "truncate"})
    assert behaviour.clip_fraction > 0.2
    assert recompute.clip_fraction == 0.0
    assert recompute.offpolicy["mismatch_kl"] == pytest.approx(behaviour.offpolicy["mismatch_kl"])
    assert {"fresh_mismatch_kl", "replayed_mismatch_kl"} <= recompute.offpolicy.keys()


def test_minibatches_step_the_optimizer_once_each_and_recompute_scores_before_the_first(
        tiny_model):
    trajectories = _trajectories(24, vocab=20)
    algorithm = {"proximal": "recompute", "importance_mode": "truncate"}
    _, one, _, loop_one = _step(tiny_model, None, trajectories, algorithm, keep_step=True)
    _, two, _, loop_two = _step(tiny_model, None, trajectories, algorithm, 2, keep_step=True)
    assert loop_one.optimizer.state[next(loop_one.model.parameters())]["step"] == 1
    assert loop_two.optimizer.state[next(loop_two.model.parameters())]["step"] == 2
    # The second minibatch is scored by moved weights: its tokens' ratio to the
    # proximal (the weights before the first update) is no longer 1, so the mismatch
    # to behaviour is measured on each update's own policy.
    assert two.ratio_mean != pytest.approx(one.ratio_mean, rel=1e-6)
    interpolated = _step(tiny_model, None, trajectories,
                         {"proximal": "interpolate", "importance_mode": "truncate"}, 2,
                         keep_step=True)[1]
    assert math.isfinite(interpolated.loss)


# --- min_tokens: the trainer scores under the engine's stop-masked law ------------------


def test_positions_under_min_tokens_are_scored_without_the_stop_tokens(tiny_model):
    from transformers import AutoModelForCausalLM

    from reflow.core.types import Segment, Trajectory
    from reflow.trainer.step import collate, sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(tiny_model)
    stops = [1, 2]
    t = Trajectory(sample_id="s", group_id="g", prompt_ids=[5, 6, 7], response_ids=[9, 10, 11, 12],
                   logprobs=[-1.0] * 4, loss_mask=[1, 1, 1, 1],
                   segments=[Segment(0, 4)], min_tokens=2)
    tb = collate([t], pad_id=0, device=torch.device("cpu"))
    assert tb.suppress[0, 2:].tolist() == [1.0, 1.0, 0.0, 0.0]  # response starts at p-1 = 2
    with torch.no_grad():
        logits = model(input_ids=tb.input_ids).logits[0, :-1] / 0.7
        masked = logits.clone()
        masked[:, stops] = float("-inf")
        want = torch.log_softmax(masked, -1).gather(-1, tb.input_ids[0, 1:, None])[:, 0]
        full = torch.log_softmax(logits, -1).gather(-1, tb.input_ids[0, 1:, None])[:, 0]
        for chunk in (None, 3):
            got = sequence_logprobs(model, tb.input_ids, tb.attention_mask, 0.7, chunk,
                                    suppress=tb.suppress, stop_ids=torch.tensor(stops))[0]
            torch.testing.assert_close(got[2:4], want[2:4])  # the masked law under min_tokens
            torch.testing.assert_close(got[4:], full[4:])  # the full law after
    # Each policy turn starts its own count; observation tokens are never suppressed.
    from reflow.trainer.step import _suppressed

    assert _suppressed([1, 1, 1, 0, 0, 1, 1], 2) == [1, 1, 0, 0, 0, 1, 1]
