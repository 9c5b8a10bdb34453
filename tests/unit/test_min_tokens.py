"""A sample's min_tokens travels with it to the trainer: the engine's logprobs at
its first min_tokens positions are of the law without the stop tokens (vLLM's
processed logprobs), which the trainer needs to score them under the same law;
and the stop tokens a model's engine suppresses, read from its directory."""

import json
import shutil

import pytest

from reflow.core.types import Segment, Trajectory
from reflow.models.tokens import stop_token_ids
from reflow.rollout.engine import SamplingSpec
from reflow.rollout.episode import EpisodeLimits, EpisodeResult
from reflow.rollout.records import PartialSample
from reflow.wire import trajectory_from_bytes, trajectory_to_bytes
from tests.unit.test_episode import Endless, ScriptedEngine, play, turn


def _trajectory(**fields) -> Trajectory:
    return Trajectory(sample_id="s", group_id="g", prompt_ids=[1, 2], response_ids=[3, 4, 5],
                      logprobs=[-0.1, -0.2, -0.3], loss_mask=[1, 1, 1],
                      segments=[Segment(0, 3)], **fields)


def test_a_trajectory_carries_its_min_tokens_over_the_wire():
    assert _trajectory().min_tokens == 0
    t = _trajectory(min_tokens=2)
    assert trajectory_from_bytes(trajectory_to_bytes(t)).min_tokens == 2
    assert trajectory_from_bytes(trajectory_to_bytes(_trajectory())).min_tokens == 0
    with pytest.raises(ValueError, match="min_tokens -1"):
        _trajectory(min_tokens=-1)


def test_samples_and_episodes_keep_the_min_tokens_they_were_generated_under():
    assert PartialSample().min_tokens == 0 and PartialSample(min_tokens=4).min_tokens == 4
    assert EpisodeResult(prompt_ids=[]).min_tokens == 0
    # Every policy turn of an episode is a request under the same min_tokens (fewer
    # where fewer tokens are left, and then the turn is all under it).
    engine = ScriptedEngine([turn("a b c")] * 3)
    result = play(engine, Endless(), limits=EpisodeLimits(max_turns=3),
                  sampling=SamplingSpec(max_tokens=64, min_tokens=2))
    assert result.min_tokens == 2
    assert [request[2].min_tokens for request in engine.requests] == [2, 2, 2]


def test_the_stop_tokens_are_the_tokenizer_s_eos_and_the_generation_config_s(tiny_model,
                                                                            tmp_path):
    assert stop_token_ids(tiny_model) == [1]  # <|endoftext|>, in both
    model = shutil.copytree(tiny_model, tmp_path / "model")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 7, 9]}))
    assert stop_token_ids(model) == [1, 7, 9]
    # Without a generation config, vLLM derives one from config.json.
    (model / "generation_config.json").unlink()
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "eos_token_id": 5}))
    assert stop_token_ids(model) == [1, 5]
