"""Run as a script (vLLM's tensor-parallel workers are spawned processes): a
TP = 2 vLLM-CPU engine joins a trainer's weight-sync group with one rank per
TP worker (weightsync.RankPlan), receives another model's weights, and samples
with them. Prints one JSON line: how far the engine's logprobs are from each
model's, scored by Hugging Face."""

from __future__ import annotations

import asyncio
import json
import sys
import threading


def main(old_path: str, new_path: str) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from reflow.procs import free_port
    from reflow.rollout.engine import SamplingSpec, WeightSyncSpec
    from reflow.rollout.vllm_engine import VllmEngine
    from reflow.weightsync import RankPlan, make_group, new_rendezvous_key, send_weights, specs_of

    engine = VllmEngine(old_path, kv_cache_gb=1, max_model_len=256, tensor_parallel_size=2)
    new = AutoModelForCausalLM.from_pretrained(new_path, dtype=torch.float32)  # nosec B615
    old = AutoModelForCausalLM.from_pretrained(old_path, dtype=torch.float32)  # nosec B615
    named = list(new.named_parameters())
    plan = RankPlan.for_engines([2])
    port, key = free_port(), new_rendezvous_key()
    spec = WeightSyncSpec("127.0.0.1", port, plan.first_rank(0), plan.world_size, "gloo",
                          [(s.name, list(s.shape), s.dtype) for s in specs_of(named)], 1 << 20,
                          tensor_parallel_size=2, rendezvous_key=key)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    joined = asyncio.run_coroutine_threadsafe(engine.init_weight_sync(spec), loop)
    group = make_group("127.0.0.1", port, 0, plan.world_size, "gloo", timeout_s=120,
                       rendezvous_key=key)
    joined.result(120)
    received = asyncio.run_coroutine_threadsafe(engine.receive_weights(), loop)
    send_weights(group, named, bucket_bytes=1 << 20)
    received.result(120)
    prompt, logprobs = [5, 6, 7, 8], []

    async def generate() -> list[int]:
        out = []
        async for delta in engine.generate("r1", prompt, SamplingSpec(max_tokens=8, seed=3)):
            out += delta.token_ids
            logprobs.extend(delta.logprobs)
        return out

    tokens = asyncio.run_coroutine_threadsafe(generate(), loop).result(120)
    ids = torch.tensor([prompt + tokens])
    gaps = {}
    for label, model in (("new", new), ("old", old)):
        with torch.no_grad():
            logits = model(ids).logits[0, len(prompt) - 1:-1]
        ref = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(tokens)[:, None])[:, 0]
        gaps[label] = float((ref - torch.tensor(logprobs)).abs().max())
    print(json.dumps({"world_size": plan.world_size, "ranks": plan.engine_ranks[0],
                      "tokens": len(tokens), "max_logprob_gap": gaps}), flush=True)
    engine.shutdown()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
