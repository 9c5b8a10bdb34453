"""Adapter-only weight sync into real vLLM (adapter_sync.py): the engine samples
from the adapter the trainer published, a sample in flight across a sync
continues under the new adapter with each token's log-prob the one its adapter
gives, and the sync check (trainer/sync_check.py) catches an engine left on a
stale adapter, the failure verl's asynchronous LoRA shipped with."""

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
from reflow.trainer.lora import apply_lora, synced_parameters
from reflow.trainer.sync_check import (WeightSyncMismatch, check_engine, probe_token_ids,
                                       trainer_probe_logprobs)
from reflow.weightsync import make_group, new_rendezvous_key, send_weights, specs_of

pytestmark = pytest.mark.slow


def _logprobs(model, prompt_ids, response_ids):
    ids = torch.tensor([prompt_ids + response_ids])
    with torch.no_grad():
        logp = torch.log_softmax(model(ids).logits[0].float(), -1)
    p = len(prompt_ids)
    return [logp[p - 1 + k, tok].item() for k, tok in enumerate(response_ids)]


def _train(model, seed: int) -> None:
    """What a few optimizer steps do to the adapters, large enough to change the
    policy visibly: new A and B for every adapter."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.3)


def test_the_engine_samples_from_each_published_adapter_and_a_stale_one_fails_the_check(
        redis_server, redis_client, tiny_model):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from reflow.rollout.service import _vllm_factory
    from reflow.rollout.worker import RolloutWorker

    spec = parse_job_spec({
        "name": "lora-engine", "model": {"path": tiny_model}, "mode": "fully_async",
        "rollout": {"group_size": 4, "max_tokens": 48},
        "trainer": {"batch_size": 8}, "replay": {"max_staleness": 5},
        "lora": {"rank": 4, "alpha": 8}})
    store = ReplayStore.from_url(redis_server.url)
    replay = InprocReplayClient(store)
    replay.configure("lora-engine", spec.replay)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    apply_lora(policy, spec.lora)
    base = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
    probe = probe_token_ids(len(tokenizer))

    def expected():
        return trainer_probe_logprobs(policy, probe, torch.device("cpu"), 1024)

    worker = RolloutWorker(
        "lora-engine", spec, _vllm_factory(spec), RepeatTask(context=TaskContext(seed=0)),
        replay, encode=lambda prompt: tokenizer.encode(prompt.text, add_special_tokens=False),
        decode=lambda ids: tokenizer.decode(ids, skip_special_tokens=True))
    worker.start()
    try:
        worker.wait_ready(300)
        # Version 0: the engine's zero adapter is the base model, as the trainer's is.
        version, got = worker.score_tokens(probe)
        diff0 = check_engine("e0", 0, version, expected(), got, 1e-3, adapter=True)

        named = synced_parameters(policy)
        port, key = free_port(), new_rendezvous_key()
        sync = WeightSyncSpec("127.0.0.1", port, 1, 2, "gloo",
                              [(s.name, list(s.shape), s.dtype) for s in specs_of(named)],
                              1 << 26, rendezvous_key=key)
        group = {}
        t = threading.Thread(target=lambda: group.setdefault("g", make_group(
            "127.0.0.1", port, 0, 2, "gloo", rendezvous_key=key)))
        t.start()
        worker.init_weight_sync(sync)
        t.join()

        def publish(version: int) -> None:
            sender = threading.Thread(target=lambda: send_weights(group["g"], named))
            sender.start()
            worker.update_weights(version)
            sender.join()

        # Samples mid-generation when adapter v1 arrives: they continue under it.
        prompts = RepeatTask(context=TaskContext(seed=0)).prompts()
        for i in range(2):
            assert worker.submit_group(f"g{i}", next(prompts), 8)
        deadline = time.monotonic() + 60
        while worker.counters.generated_tokens_total < 40:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        v0_policy = AutoModelForCausalLM.from_pretrained(tiny_model).eval()
        _train(policy, seed=1)
        publish(1)
        version, got = worker.score_tokens(probe)
        diff1 = check_engine("e0", 1, version, expected(), got, 1e-3, adapter=True)
        deadline = time.monotonic() + 120
        while store.stats("lora-engine").unused_samples < 8 and time.monotonic() < deadline:
            time.sleep(0.2)
        batch = store.lease("lora-engine", store.stats("lora-engine").unused_samples, 60,
                            timeout_s=1)

        # A second publish, then a third version the engine never receives: the
        # check fails on the stale adapter, naming the engine and the version.
        _train(policy, seed=2)
        publish(2)
        version, got = worker.score_tokens(probe)
        check_engine("e0", 2, version, expected(), got, 1e-3, adapter=True)
        _train(policy, seed=3)
        version, got = worker.score_tokens(probe)
        with pytest.raises(WeightSyncMismatch, match=r"rollout engine e0 does not sample from "
                           r"the adapter the trainer published as v2"):
            check_engine("e0", 2, version, expected(), got, 1e-3, adapter=True)
    finally:
        worker.stop()

    print(f"probe |Δ log-prob| engine vs trainer: v0 {diff0:.2e}, v1 {diff1:.2e}")
    # The engine sampled under the adapter, not the base model: v1's tokens have
    # the adapter model's log-probs, and those differ from the base model's.
    spanning = [t for t in batch.trajectories if [s.policy_version for s in t.segments] == [0, 1]]
    assert spanning, [t.segments for t in batch.trajectories]
    _train(policy, seed=1)  # back to v1's adapter
    gaps = []
    for traj in batch.trajectories:
        lp_v0 = _logprobs(v0_policy, traj.prompt_ids, traj.response_ids)
        lp_v1 = _logprobs(policy, traj.prompt_ids, traj.response_ids)
        lp_base = _logprobs(base, traj.prompt_ids, traj.response_ids)
        k = 0
        for seg in traj.segments:
            want = lp_v0 if seg.policy_version == 0 else lp_v1
            for i in range(k, k + seg.num_tokens):
                assert abs(traj.logprobs[i] - want[i]) < 1e-3, (traj.segments, i)
                if seg.policy_version == 1:
                    gaps.append(abs(lp_v1[i] - lp_base[i]))
            k += seg.num_tokens
    # Else the base model would have passed the check above as well.
    assert gaps and max(gaps) > 0.05, "adapter v1 barely changes the policy: the test shows nothing"
