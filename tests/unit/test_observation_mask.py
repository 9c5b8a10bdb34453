"""Observation tokens of a multi-turn trajectory (loss mask 0) carry no policy
gradient: the trainer's own collate and loss, on a tiny causal LM, give them
exactly zero gradient, and they reach the loss only as context of the policy
tokens after them."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from reflow.core.types import Segment, Trajectory
from reflow.trainer.loss import grpo_token_loss, token_logprobs
from reflow.trainer.step import collate, sequence_logprobs

TEMPERATURE = 0.7
PROMPT = [5, 6, 7]
POLICY_1, POLICY_2 = [10, 11, 12], [13, 14, 15]
OBSERVATION = [20, 21, 22, 23]


@pytest.fixture(scope="module")
def model():
    config = AutoConfig.for_model("qwen3", hidden_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                  intermediate_size=64, vocab_size=64)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def forward(model, trajectories):
    """The trainer's scoring (trainer/step.py compute_step): logits of every position
    but the last, over the sampling temperature, scored on the next tokens."""
    tb = collate(trajectories, pad_id=0, device=torch.device("cpu"))
    logits = model(input_ids=tb.input_ids, attention_mask=tb.attention_mask).logits
    if logits.requires_grad:
        logits.retain_grad()  # to read the gradient at each position
    new_logprobs = token_logprobs(logits[:, :-1] / TEMPERATURE, tb.input_ids[:, 1:])
    return tb, logits, new_logprobs


def episode(observation, policy_2_in_loss, logprobs=None):
    response = POLICY_1 + observation + POLICY_2
    mask = [1] * 3 + [0] * len(observation) + [int(policy_2_in_loss)] * 3
    return Trajectory(sample_id="s0", group_id="g", prompt_ids=PROMPT, response_ids=response,
                      logprobs=logprobs or [0.0] * len(response), loss_mask=mask,
                      segments=[Segment(0, len(response))], advantage=1.0)


def single_turn():
    return Trajectory(sample_id="s1", group_id="g", prompt_ids=[5, 9], response_ids=[16, 17],
                      logprobs=[-2.0, -2.5], loss_mask=[1, 1], segments=[Segment(0, 2)],
                      advantage=-1.0)


def on_policy(model, trajectory):
    """The trajectory with behaviour logprobs equal to the model's own (ratio 1:
    nothing is clipped, so every loss token has a gradient)."""
    with torch.no_grad():
        _, _, new = forward(model, [trajectory])
    p = len(trajectory.prompt_ids)
    logprobs = new[0, p - 1:p - 1 + len(trajectory.response_ids)].tolist()
    return episode(trajectory.response_ids[3:-3], bool(trajectory.loss_mask[-1]),
                   [lp if m else 0.0 for lp, m in zip(logprobs, trajectory.loss_mask)])


def loss_of(model, trajectories, kl_coef=0.0):
    tb, logits, new = forward(model, trajectories)
    # A reference model's logprobs, for the KL penalty: any values will do.
    reference = torch.linspace(-3.0, -0.5, new.numel()).view_as(new)
    loss, _ = grpo_token_loss(new, tb.old_logprobs, tb.advantages, tb.loss_mask, clip_eps=0.2,
                              ref_logprobs=reference, kl_coef=kl_coef)
    return loss, logits


def trainer_loss(model, trajectories, chunk_tokens):
    """The loss as compute_step scores it (full logits, or chunks of positions)."""
    tb = collate(trajectories, pad_id=0, device=torch.device("cpu"))
    new = sequence_logprobs(model, tb.input_ids, tb.attention_mask, TEMPERATURE, chunk_tokens)
    return grpo_token_loss(new, tb.old_logprobs, tb.advantages, tb.loss_mask, clip_eps=0.2)[0]


@pytest.mark.parametrize("kl_coef", [0.0, 0.1])
def test_observation_positions_get_exactly_zero_gradient(model, kl_coef):
    trajectory = on_policy(model, episode(OBSERVATION, policy_2_in_loss=True))
    loss, logits = loss_of(model, [trajectory, single_turn()], kl_coef)
    loss.backward()
    grad = logits.grad[0]
    p = len(PROMPT)
    # Position j predicts token j+1: response token k is predicted at p-1+k.
    predicts_observation = range(p - 1 + 3, p - 1 + 3 + len(OBSERVATION))
    predicts_policy = [p - 1 + k for k in (0, 1, 2, 7, 8, 9)]
    for j in predicts_observation:
        assert torch.equal(grad[j], torch.zeros_like(grad[j])), f"position {j}"
    for j in predicts_policy:
        assert grad[j].abs().sum() > 0, f"position {j}"
    # The prompt's positions and the last one predict nothing trained either.
    assert torch.equal(grad[: p - 1], torch.zeros_like(grad[: p - 1]))
    assert torch.equal(grad[-1], torch.zeros_like(grad[-1]))


@pytest.mark.parametrize("chunk_tokens", [None, 4])
def test_observation_tokens_reach_the_loss_only_through_later_policy_tokens(model, chunk_tokens):
    other = [30, 31, 32, 33]

    def loss(observation, policy_2_in_loss):
        return trainer_loss(model, [episode(observation, policy_2_in_loss), single_turn()],
                            chunk_tokens)

    with torch.no_grad():
        # Only the turn before the observation trains: the observation is context of
        # nothing in the loss, so its tokens cannot change it, bit for bit.
        assert torch.equal(loss(OBSERVATION, False), loss(other, False))
        # With the turn after it in the loss, the observation is that turn's context.
        assert not torch.equal(loss(OBSERVATION, True), loss(other, True))
