import math

import pytest
import torch

from reflow.trainer.loss import (chunked_token_logprobs, grpo_token_loss, reference_kl,
                                 token_logprobs)


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


# --- the KL penalty to a frozen reference (k3) ----------------------------------------


def test_reference_kl_matches_a_hand_computed_k3():
    new = torch.tensor([[math.log(0.5), math.log(0.2)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.4)]])
    kl = reference_kl(new, ref, torch.ones(1, 2))
    # k3 = r - log r - 1 with r = p_ref / p_new: 0.5 - log 0.5 - 1 and 2 - log 2 - 1.
    expected = [0.5 - math.log(0.5) - 1.0, 2.0 - math.log(2.0) - 1.0]
    assert kl[0].tolist() == pytest.approx(expected, rel=1e-6)


def test_kl_penalty_adds_its_coefficient_times_the_token_mean():
    new = torch.tensor([[math.log(0.5), math.log(0.2)], [math.log(0.3), math.log(0.9)]])
    ref = torch.tensor([[math.log(0.25), math.log(0.4)], [math.log(0.3), math.log(0.1)]])
    old, adv = new.clone(), torch.tensor([1.0, -0.5])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    plain, plain_stats = grpo_token_loss(new, old, adv, mask, 0.2)
    penalised, stats = grpo_token_loss(new, old, adv, mask, 0.2, ref_logprobs=ref, kl_coef=0.1)
    k3 = [0.5 - math.log(0.5) - 1.0, 2.0 - math.log(2.0) - 1.0, 0.0]  # third: ref == new
    assert stats.kl == pytest.approx(sum(k3) / 3, rel=1e-6)
    assert penalised.item() == pytest.approx(plain.item() + 0.1 * sum(k3) / 3, rel=1e-6)
    assert plain_stats.kl == 0.0
    # Micro-batch form: normalised by the whole step's tokens, as the policy term.
    part, _ = grpo_token_loss(new, old, adv, mask, 0.2, num_batch_tokens=6, ref_logprobs=ref,
                              kl_coef=0.1)
    assert part.item() == pytest.approx((plain.item() * 3 + 0.1 * sum(k3)) / 6, rel=1e-6)


def test_kl_is_zero_with_zero_gradient_when_policy_is_the_reference():
    lp = torch.log(torch.tensor([[0.3, 0.4, 0.5]])).requires_grad_(True)
    kl = reference_kl(lp, lp.detach(), torch.ones(1, 3))
    assert kl.abs().max().item() == 0.0
    kl.sum().backward()
    assert lp.grad.abs().max().item() == 0.0


def test_kl_gradient_pulls_the_policy_towards_the_reference():
    ref = torch.log(torch.tensor([[0.3, 0.3]]))
    # Token 0: the policy likes it more than the reference, token 1 less.
    new = torch.log(torch.tensor([[0.6, 0.1]])).requires_grad_(True)
    loss, _ = grpo_token_loss(new, new.detach(), torch.zeros(1), torch.ones(1, 2), 0.2,
                              ref_logprobs=ref, kl_coef=1.0)
    loss.backward()
    # d k3 / d new = 1 - exp(ref - new): descent lowers token 0 and raises token 1.
    assert new.grad[0, 0].item() > 0 and new.grad[0, 1].item() < 0
    assert new.grad[0, 0].item() == pytest.approx((1 - 0.3 / 0.6) / 2, rel=1e-5)


def test_masked_tokens_add_no_kl_and_no_gradient():
    # Padding positions may hold any value, even ones whose exp() would overflow.
    new = torch.tensor([[math.log(0.5), -1e4]], requires_grad=True)
    ref = torch.tensor([[math.log(0.25), 50.0]])
    mask = torch.tensor([[1.0, 0.0]])
    loss, stats = grpo_token_loss(new, new.detach(), torch.zeros(1), mask, 0.2,
                                  ref_logprobs=ref, kl_coef=1.0)
    loss.backward()
    assert stats.kl == pytest.approx(0.5 - math.log(0.5) - 1.0, rel=1e-6)
    assert math.isfinite(loss.item()) and new.grad[0, 1].item() == 0.0


# --- log-probabilities by chunks of positions ---------------------------------------


def _tiny_llama(vocab: int = 97):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).double().train()


def test_chunked_logprobs_equal_full_logits():
    head = torch.nn.Linear(8, 13, bias=False)
    hidden = torch.randn(3, 5, 8)
    targets = torch.randint(0, 13, (3, 5))
    full = token_logprobs(head(hidden) / 0.7, targets)
    for chunk in (1, 4, 15, 1000):
        torch.testing.assert_close(chunked_token_logprobs(hidden, targets, head, 0.7, chunk), full)
    with pytest.raises(ValueError, match="chunk_tokens"):
        chunked_token_logprobs(hidden, targets, head, 1.0, 0)


@pytest.mark.parametrize("chunk", [1, 7, 64, 4096])
def test_chunked_scoring_takes_the_unchunked_loss_and_gradients(chunk):
    """A model built from a config (float64 so only the algorithm can differ): the
    GRPO loss and every parameter's gradient from chunked, checkpointed scoring of
    the hidden states equal those of the full-logits forward."""
    from reflow.trainer.step import sequence_logprobs

    model = _tiny_llama()
    torch.manual_seed(1)
    ids = torch.randint(0, 97, (3, 12))
    attention = torch.ones_like(ids)
    attention[2, 9:] = 0  # a right-padded sequence
    old = -torch.rand(3, 11, dtype=torch.float64) * 3
    mask = attention[:, 1:].to(torch.float64)
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=torch.float64)

    def loss_and_grads(chunk_tokens):
        model.zero_grad(set_to_none=True)
        lp = sequence_logprobs(model, ids, attention, 0.8, chunk_tokens).double()
        loss, _ = grpo_token_loss(lp, old, adv, mask, 0.2, ref_logprobs=old.flip(-1), kl_coef=0.3)
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}

    want_loss, want = loss_and_grads(None)
    got_loss, got = loss_and_grads(chunk)
    torch.testing.assert_close(got_loss, want_loss, rtol=1e-6, atol=1e-9)
    assert want.keys() == got.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-6, atol=1e-9, msg=name)
