import math

import pytest
import torch

from reflow.trainer.loss import grpo_token_loss, token_logprobs


def test_grpo_loss_matches_hand_computed_example():
    # Two samples, two tokens each; the second sample's second token is padding.
    new = torch.tensor([[math.log(0.5), math.log(0.25)], [math.log(0.1), math.log(0.3)]])
    old = torch.tensor([[math.log(0.25), math.log(0.25)], [math.log(0.2), 0.0]])
    adv = torch.tensor([1.0, -1.0])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    loss, stats = grpo_token_loss(new, old, adv, mask, clip_eps=0.2)
    # Ratios: sample 0 -> [2.0, 1.0]; sample 1 -> [0.5].
    # Sample 0, A=+1: min(2.0, clip 1.2) = 1.2 and min(1.0, 1.0) = 1.0.
    # Sample 1, A=-1: min(-0.5, -0.8) = -0.8 (the clipped side is the pessimistic one).
    # Token mean over 3 loss tokens: -(1.2 + 1.0 - 0.8) / 3.
    assert loss.item() == pytest.approx(-(1.2 + 1.0 - 0.8) / 3, rel=1e-6)
    assert stats.clip_fraction == pytest.approx(2 / 3)


def test_clipped_tokens_carry_no_gradient():
    new = torch.tensor([[math.log(0.5), math.log(0.25)]], requires_grad=True)
    old = torch.tensor([[math.log(0.25), math.log(0.25)]])
    loss, _ = grpo_token_loss(new, old, torch.tensor([1.0]), torch.ones(1, 2), clip_eps=0.2)
    loss.backward()
    # Token 0 is clipped (ratio 2 > 1.2 with A > 0); token 1 has ratio 1: d/dnew = -ratio*A/2.
    assert new.grad[0, 0].item() == 0.0
    assert new.grad[0, 1].item() == pytest.approx(-0.5)


def test_on_policy_loss_is_minus_mean_advantage_and_weights_scale_samples():
    lp = torch.log(torch.tensor([[0.3, 0.4, 0.5], [0.2, 0.2, 0.2]]))
    adv = torch.tensor([2.0, -1.0])
    mask = torch.ones(2, 3)
    loss, stats = grpo_token_loss(lp, lp, adv, mask, clip_eps=0.2)
    assert loss.item() == pytest.approx(-(3 * 2.0 + 3 * -1.0) / 6)
    assert stats.approx_kl == pytest.approx(0.0, abs=1e-7)
    weighted, _ = grpo_token_loss(lp, lp, adv, mask, 0.2, sample_weights=torch.tensor([0.5, 1.0]))
    assert weighted.item() == pytest.approx(-(3 * 1.0 + 3 * -1.0) / 6)


def test_token_logprobs_equal_log_softmax():
    logits = torch.randn(2, 5, 11)
    targets = torch.randint(0, 11, (2, 5))
    expected = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    torch.testing.assert_close(token_logprobs(logits, targets), expected)
