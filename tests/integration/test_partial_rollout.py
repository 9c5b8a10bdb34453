"""Partial rollout on real vLLM (paper §4.1 step 4): a weight update arrives
while samples are mid-generation; they pause at a token boundary, continue
under the new weights, and record both versions. Every token's behaviour
logprob must be the logprob under the policy that generated that token."""

import threading
import time

import pytest
import torch

from reflow.core.config import parse_job_spec
from reflow.procs import free_port
from reflow.replay.client import InprocReplayClient
from reflow.replay.store import ReplayStore
from reflow.rollout.engine import WeightSyncSpec
from reflow.tasks import TaskContext
from reflow.tasks.repeat import RepeatTask
from reflow.weightsync import make_group, new_rendezvous_key, send_weights, specs_of

pytestmark = pytest.mark.slow


def _logprobs(model, prompt_ids, response_ids):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    p = len(prompt_ids)
    return [logp[p - 1 + k, tok].item() for k, tok in enumerate(response_ids)]


def test_segments_carry_two_versions_with_the_engines_logprobs(redis_server, redis_client, tiny_model,
                                                               tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reflow.models.tiny import build_tiny_qwen3
    from reflow.rollout.service import _vllm_factory
    from reflow.rollout.worker import RolloutWorker

    other = build_tiny_qwen3(tmp_path / "other", seed=7)
    model_a = AutoModelForCausalLM.from_pretrained(tiny_model)
    model_b = AutoModelForCausalLM.from_pretrained(other)
    spec = parse_job_spec({
        "name": "partial", "model": {"path": tiny_model}, "mode": "fully_async",
        "rollout": {"group_size": 4, "max_tokens": 48},
        "trainer": {"batch_size": 8},
        "replay": {"max_staleness": 5},
    })
    store = ReplayStore.from_url(redis_server.url)
    replay = InprocReplayClient(store)
    replay.configure("partial", spec.replay)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    worker = RolloutWorker(
        "partial", spec, _vllm_factory(spec), RepeatTask(context=TaskContext(seed=0)), replay,
        encode=lambda prompt: tokenizer.encode(prompt.text, add_special_tokens=False),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True),
    )
    started = time.monotonic()
    worker.start()
    try:
        named = list(model_b.named_parameters())
        port, key = free_port(), new_rendezvous_key()
        sync = WeightSyncSpec("127.0.0.1", port, 1, 2, "gloo",
                              [(s.name, list(s.shape), s.dtype) for s in specs_of(named)], 1 << 26,
                              rendezvous_key=key)
        group = {}
        t = threading.Thread(target=lambda: group.setdefault("g", make_group(
            "127.0.0.1", port, 0, 2, "gloo", rendezvous_key=key)))
        t.start()
        worker.init_weight_sync(sync)
        t.join()
        # What the job's dispatcher would do: two groups fill the 8 slots.
        prompts = RepeatTask(context=TaskContext(seed=0)).prompts()
        for i in range(2):
            assert worker.submit_group(f"g{i}", next(prompts), 8)
        # Wait until samples are mid-generation, then swap in model B as version 1.
        deadline = time.monotonic() + 60
        while worker.counters.generated_tokens_total < 40:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        sender = threading.Thread(target=lambda: send_weights(group["g"], named))
        sender.start()
        worker.update_weights(1)
        sender.join()
        deadline = time.monotonic() + 120
        while store.stats("partial").unused_samples < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
    finally:
        worker.stop()

    batch = store.lease("partial", store.stats("partial").unused_samples, 60, timeout_s=1)
    # The engine's own step count and busy time: every token of the longest sample
    # took a step of its own, and a step decodes at most the 8 samples running.
    c = worker.counters
    longest = max(len(t.response_ids) for t in batch.trajectories)
    assert longest <= c.engine_decode_steps_total <= c.generated_tokens_total
    assert c.generated_tokens_total <= 8 * c.engine_decode_steps_total
    assert 0 < c.engine_busy_seconds_total <= time.monotonic() - started
    spanning = [t for t in batch.trajectories if [s.policy_version for s in t.segments] == [0, 1]]
    assert spanning, [t.segments for t in batch.trajectories]
    for traj in batch.trajectories:
        lp_a = _logprobs(model_a, traj.prompt_ids, traj.response_ids)
        lp_b = _logprobs(model_b, traj.prompt_ids, traj.response_ids)
        k = 0
        for seg in traj.segments:
            expected = lp_a if seg.policy_version == 0 else lp_b
            for i in range(k, k + seg.num_tokens):
                assert abs(traj.logprobs[i] - expected[i]) < 1e-3, (traj.segments, i)
            k += seg.num_tokens
