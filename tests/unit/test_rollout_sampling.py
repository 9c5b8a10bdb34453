"""What the engines sample with: rollout.top_p / top_k reach vLLM's SamplingParams
and the evaluation's law, and training refuses a truncated law (the trainer
scores the full one: a biased ratio)."""

import asyncio
import sys
import types
from types import SimpleNamespace

import pytest

from reflow.core.config import JobSpecError, parse_job_spec
from reflow.core.rollout_config import RolloutConfig
from reflow.rollout.engine import SamplingSpec


@pytest.mark.parametrize("field, value", [("top_p", 0.9), ("top_k", 50)])
def test_training_refuses_a_truncated_sampling_law_and_says_why(field, value):
    with pytest.raises(JobSpecError) as err:
        parse_job_spec({"model": {"path": "m"}, "rollout": {field: value}})
    message = str(err.value)
    assert f"rollout.{field}: {value:g} truncates the sampling distribution" in message
    assert "behaviour log-probs would be those of the truncated law" in message
    assert "biased importance ratio" in message
    assert "Leave rollout.top_p at 1 and rollout.top_k at 0" in message


def test_the_untruncated_law_is_the_default_and_out_of_range_values_name_the_field():
    rollout = RolloutConfig()
    assert (rollout.top_p, rollout.top_k) == (1.0, 0)
    assert (SamplingSpec(max_tokens=4).top_p, SamplingSpec(max_tokens=4).top_k) == (1.0, 0)
    for bad in ({"top_p": 0.0}, {"top_p": 1.5}, {"top_k": -1}):
        with pytest.raises(JobSpecError, match=f"rollout.{next(iter(bad))}"):
            parse_job_spec({"model": {"path": "m"}, "rollout": bad})


def _fake_vllm(monkeypatch) -> list[dict]:
    """`vllm` as VllmEngine.generate imports it, recording SamplingParams' arguments
    (the real import takes seconds)."""
    seen: list[dict] = []
    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: seen.append(kw) or kw
    vllm.TokensPrompt = dict
    sampling_params = types.ModuleType("vllm.sampling_params")
    sampling_params.RequestOutputKind = SimpleNamespace(FINAL_ONLY="final")
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.sampling_params", sampling_params)
    return seen


def test_the_vllm_engine_samples_with_the_spec_s_truncation_and_min_tokens(monkeypatch):
    from reflow.rollout.vllm_engine import VllmEngine

    seen = _fake_vllm(monkeypatch)

    class Core:
        async def generate(self, prompt, params, request_id, lora_request=None):
            assert lora_request is None  # no LoRA in this spec
            completion = SimpleNamespace(token_ids=[5], logprobs=[{5: SimpleNamespace(
                logprob=-0.5)}], finish_reason="stop", weight_versions=None)
            yield SimpleNamespace(outputs=[completion], finished=True)

    engine = VllmEngine.__new__(VllmEngine)
    engine._engine = Core()
    engine.lora = None

    async def run(spec):
        return [d async for d in engine.generate("r", [1, 2], spec)]

    deltas = asyncio.run(run(SamplingSpec(max_tokens=8, min_tokens=3, temperature=0.7,
                                          top_p=0.8, top_k=20)))
    assert deltas[0].logprobs == [-0.5]
    assert {k: seen[0][k] for k in ("max_tokens", "min_tokens", "temperature", "top_p",
                                    "top_k", "logprobs")} == {
        "max_tokens": 8, "min_tokens": 3, "temperature": 0.7, "top_p": 0.8, "top_k": 20,
        "logprobs": 0}
    asyncio.run(run(SamplingSpec(max_tokens=8)))
    assert (seen[1]["top_p"], seen[1]["top_k"]) == (1.0, 0)  # vLLM's "off" for both


def test_evaluation_samples_greedily_or_with_the_training_law(monkeypatch):
    from reflow.rollout import evaluation

    laws: list[SamplingSpec] = []

    class Engine:
        async def generate(self, request_id, prompt_ids, sampling):
            laws.append(sampling)
            yield SimpleNamespace(token_ids=[1])

    class Resumed:
        async def wait(self):
            return True

    rollout = SimpleNamespace(max_tokens=6, temperature=0.5, top_p=0.9, top_k=7)
    worker = SimpleNamespace(
        _resumed=Resumed(), counters=SimpleNamespace(policy_version=3),
        task=SimpleNamespace(eval_prompts=lambda n: ["p"]), spec=SimpleNamespace(rollout=rollout),
        episodes=None, engine=Engine(), encode=lambda p: [1], decode=lambda ids: "x",
        score=lambda prompt, text: SimpleNamespace(value=1.0, error=""))

    async def score_texts(score, prompt, texts):
        return [score(prompt, t) for t in texts]

    monkeypatch.setattr(evaluation, "score_texts", score_texts)
    asyncio.run(evaluation.run_evaluation(worker, evaluation.EvalPlan(1, greedy=True)))
    asyncio.run(evaluation.run_evaluation(worker, evaluation.EvalPlan(1, greedy=False)))
    assert (laws[0].temperature, laws[0].top_p, laws[0].top_k) == (0.0, 1.0, 0)
    assert (laws[1].temperature, laws[1].top_p, laws[1].top_k) == (0.5, 0.9, 7)
