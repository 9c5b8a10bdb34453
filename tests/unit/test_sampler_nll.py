"""bench/sampler_parity.py's finer check: the trainer's negative log-likelihood a response
token of one prompt's samples, against the same sum written out by hand."""

import importlib.util
import math
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("sampler_parity", REPO / "bench" / "sampler_parity.py")
parity = importlib.util.module_from_spec(_spec)
sys.modules["sampler_parity"] = parity
_spec.loader.exec_module(parity)


def _tiny_llama(vocab: int = 53):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("llama", vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                  max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def test_the_nll_pools_response_tokens_under_the_sampling_temperature():
    model = _tiny_llama()
    prompt, responses, temperature = [5, 9, 11], [[3, 4, 7, 8], [2], []], 0.7
    expected_sum, tokens = 0.0, 0
    with torch.no_grad():
        for r in responses[:2]:
            ids = torch.tensor([prompt + r])
            logits = model(input_ids=ids).logits[0, :-1] / temperature
            logp = torch.log_softmax(logits.double(), dim=-1)
            for t in range(len(prompt) - 1, ids.shape[1] - 1):
                expected_sum -= float(logp[t, ids[0, t + 1]])
                tokens += 1
    got = parity._trainer_nll(model, prompt, responses, temperature, pad_id=0)
    assert tokens == 5  # the empty response adds nothing; the padding is masked out
    assert got == pytest.approx(expected_sum / tokens, rel=1e-4)
    # No response token at all: no estimate, not a zero.
    assert math.isnan(parity._trainer_nll(model, prompt, [[]], temperature, pad_id=0))
