"""vLLM's "Failed to load weights" warning on an in-place reload: dropped for the layers
that never receive a tensor by design (a tied LM head, derived buffers), kept for others."""

import logging
from collections import Counter

import torch

from reflow import weightsync


class Rotary(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("cos_sin_cache", torch.zeros(4, 2), persistent=False)


class Head(torch.nn.Module):
    def __init__(self, tied_to: torch.nn.Parameter | None = None) -> None:
        super().__init__()
        self.weight = tied_to if tied_to is not None else torch.nn.Parameter(torch.zeros(8, 4))


class Tiny(torch.nn.Module):
    def __init__(self, tied: bool) -> None:
        super().__init__()
        self.embed_tokens = torch.nn.Embedding(8, 4)
        self.rotary_emb = Rotary()
        self.proj = torch.nn.Linear(4, 4)
        self.lm_head = Head(self.embed_tokens.weight if tied else None)


SENT = {"embed_tokens.weight", "proj.weight", "proj.bias"}


def test_tied_head_and_buffer_only_layers_are_expected_not_to_load():
    expected = weightsync.layers_without_weights(Tiny(tied=True), SENT)
    assert expected == Counter({"Head": 1, "Rotary": 1})


def test_an_untied_head_or_a_sent_buffer_is_expected_to_load():
    assert weightsync.layers_without_weights(Tiny(tied=False), SENT) == Counter({"Rotary": 1})
    assert weightsync.layers_without_weights(
        Tiny(tied=True), SENT | {"rotary_emb.cos_sin_cache"}) == Counter({"Head": 1})


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


def test_only_the_expected_warnings_are_dropped_and_only_during_the_reload():
    reload_logger = logging.getLogger(weightsync._RELOAD_LOGGER)
    seen = _Collect()
    reload_logger.addHandler(seen)
    try:
        with weightsync.expected_reload_warnings_dropped(Counter({"ParallelLMHead": 1})):
            reload_logger.warning("%s: Failed to load weights", "ParallelLMHead")
            # A second layer of the same class failing is not the expected case.
            reload_logger.warning("%s: Failed to load weights", "ParallelLMHead")
            reload_logger.warning("%s: Failed to load weights", "QKVParallelLinear")
            reload_logger.warning("%s: Excessive loading", "ParallelLMHead")
        reload_logger.warning("%s: Failed to load weights", "ParallelLMHead")
    finally:
        reload_logger.removeHandler(seen)
    assert seen.messages == [
        "ParallelLMHead: Failed to load weights",
        "QKVParallelLinear: Failed to load weights",
        "ParallelLMHead: Excessive loading",
        "ParallelLMHead: Failed to load weights",
    ]
    assert not reload_logger.filters
