"""`GenerationEngine` on vLLM's AsyncLLM.

Partial rollout uses vLLM's own pause with `mode="keep", clear_cache=True`:
paused requests stay queued and continue under the new weights with their
KV cache recomputed, which equals a fresh run on prompt + partial response.
Each loaded version is labelled in the engine (`label_weights`), which
records per request which label sampled each token; a sample's version
segments come from there.
Weights arrive through `collective_rpc`, which calls a named method of the
engine's workers (rollout/vllm_worker.py, vLLM's worker extension) with plain
arguments; nothing is pickled, so vLLM's insecure serialization stays off.
"""

from __future__ import annotations

import logging
import os
from collections.abc import AsyncIterator

from reflow.core.lora_config import LoraConfig
from reflow.rollout.engine import EngineLoad, SamplingSpec, TokenDelta, WeightSyncSpec
from reflow.rollout.memory import EngineSleep
from reflow.rollout.vllm_worker import EXTENSION

logger = logging.getLogger(__name__)


def _load_recorder(load: EngineLoad):
    """A vLLM stat logger class that copies scheduler stats into `load`. vLLM calls
    it on its output-handler task after every engine step; SchedulerStats is not a
    stable vLLM interface, so it is read defensively here and nowhere else.

    It poses as vLLM's Prometheus logger (subclass, no set-up), because vLLM adds
    its own Prometheus logger beside any custom one otherwise: that one records a
    dozen histograms per step into a registry nobody scrapes, and cost about 6% of
    trainer throughput on the CPU quickstart. `bench/engine_stats.py` measures what
    the stats still cost; REFLOW_ENGINE_STATS=0 turns them off."""
    from vllm.v1.metrics.loggers import PrometheusStatLogger

    class LoadRecorder(PrometheusStatLogger):
        def __init__(self, vllm_config, engine_indexes=None) -> None:  # noqa: D107 - no super()
            pass

        def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx=0):
            if scheduler_stats is not None:
                load.running_requests = int(getattr(scheduler_stats, "num_running_reqs", 0))
                load.waiting_requests = int(getattr(scheduler_stats, "num_waiting_reqs", 0))
                load.kv_cache_usage_ratio = float(getattr(scheduler_stats, "kv_cache_usage", 0.0))
            if iteration_stats is not None:
                load.preempted_requests_total += int(getattr(iteration_stats, "num_preempted_reqs", 0))
                tokens = int(getattr(iteration_stats, "num_generation_tokens", 0))
                load.generated_tokens_total += tokens
                load.decode_steps_total += 1 if tokens else 0

        def record_sleep_state(self, sleep: int = 0, level: int = 0) -> None:
            pass

        def record_admission_rejection(self, reason: str) -> None:
            pass

        def log_engine_initialized(self) -> None:
            pass

        def log(self) -> None:
            pass

    return LoadRecorder


def _default_executor(tensor_parallel_size: int) -> str | None:
    """In-process on CPU (see below) unless tensor-parallel, which needs a worker
    process per shard; vLLM's own choice on GPU."""
    import torch

    if torch.cuda.is_available():
        return None
    return "mp" if tensor_parallel_size > 1 else "uni"


def _segments(spans, num_tokens: int) -> list[tuple[int, int]] | None:
    """(policy version, tokens) from vLLM's weight-version spans of a finished
    output; None where the weights were never labelled (vLLM's own default
    name). Spans that do not cover the tokens exactly, or mix labelled and
    unlabelled weights, are refused: a token's version decides its staleness
    and which policy its logprob belongs to."""
    if spans is None or all(not str(span.version).isdigit() for span in spans):
        return None
    segments, covered = [], 0
    for span in spans:
        if span.start != covered or span.end < span.start or not str(span.version).isdigit():
            raise ValueError(f"weight-version spans {spans} do not label {num_tokens} tokens")
        if span.end > span.start:
            segments.append((int(span.version), span.end - span.start))
        covered = span.end
    if covered != num_tokens:
        raise ValueError(f"weight-version spans {spans} do not label {num_tokens} tokens")
    return segments


# vLLM's priority order: lower first; every sample has 0 (its default).
PROBE_PRIORITY = -1


class VllmEngine:
    def __init__(
        self,
        model_path: str,
        dtype: str = "float32",
        kv_cache_gb: float = 1.0,
        max_model_len: int | None = None,
        seed: int = 0,
        tensor_parallel_size: int = 1,
        gpu_memory_utilization: float | None = None,
        sleep_mode: bool = False,
        lora: LoraConfig | None = None,
        max_num_seqs: int | None = None,
    ) -> None:
        """On a GPU: `gpu_memory_utilization` (None: vLLM's default) and
        `sleep_mode` (vLLM's sleep around standby, rollout/memory.py); on CPU
        neither applies and the KV cache is `kv_cache_gb`. `lora`: a LoRA job's
        adapter config: the engine runs every request under one adapter slot that
        each weight sync replaces (adapter_sync.py)."""
        self.tensor_parallel_size = tensor_parallel_size
        self.lora = lora
        self._adapter_ready = lora is None
        self._adapter_lock = None
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(max(1, int(round(kv_cache_gb)))))
        executor = os.environ.get("REFLOW_VLLM_EXECUTOR") or _default_executor(tensor_parallel_size)
        if executor == "uni":
            # vLLM-CPU only keeps the in-process executor when this is off; AsyncLLM
            # still runs its engine core as a separate process either way.
            os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        from vllm import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        args = AsyncEngineArgs(
            model=model_path,
            dtype=dtype,
            seed=seed,
            max_model_len=max_model_len,
            tensor_parallel_size=tensor_parallel_size,
            enforce_eager=True,
            # On CPU, the model worker inside the engine-core process. vLLM-CPU otherwise
            # starts it as a third process that the engine core talks to over a
            # shared-memory queue both sides spin on (sched_yield): the profile
            # (bench/PROFILE.md) found half the engine's CPU samples there. Tensor-
            # parallel engines need the multiprocess executor, chosen for them.
            distributed_executor_backend=executor,
            # Logprobs of the law sampled from: after min_tokens' end-of-sequence mask,
            # temperature and top-k/top-p (checked on vLLM-CPU 0.32: at a position
            # under min_tokens the sampled token's logprob is log_softmax(logits / T)
            # over the vocabulary less the stop tokens). raw_logprobs would be before
            # all of them, the temperature included.
            logprobs_mode="processed_logprobs",
            disable_log_stats=True,
            # Weight sync and KV-cache release, called by name (rollout/vllm_worker.py).
            worker_extension_cls=EXTENSION,
            enable_sleep_mode=sleep_mode,
            # One adapter slot: the job's policy, replaced in place at each sync. With
            # LoRA on, vLLM-CPU runs without torch compilation (bench/lora.py measures it).
            # Only the job's target layers are wrapped: vLLM would otherwise wrap the LM
            # head too, whose CPU LoRA path breaks prompt log-probabilities (the sync
            # check's) in a batch of several requests (einsum over mismatched sizes,
            # vLLM-CPU 0.32), and costs a pass over the vocabulary for nothing.
            **({"enable_lora": True, "max_lora_rank": lora.engine_slot_rank, "max_loras": 1,
                "max_cpu_loras": 1, "lora_target_modules": list(lora.target_modules)}
               if lora is not None else {}),
            **({"gpu_memory_utilization": gpu_memory_utilization}
               if gpu_memory_utilization is not None else {}),
            # With a batch limit, requests wait in the engine's queue; the weight-sync
            # check's probe (score) must not wait behind a queue of samples, or the
            # trainer's start and every sync wait for it: priority order, the probe
            # first, samples first come first served among themselves.
            **({"max_num_seqs": max_num_seqs, "scheduling_policy": "priority"}
               if max_num_seqs is not None else {}),
        )
        # Our recorder replaces vLLM's periodic log line; it only keeps the numbers.
        self.load: EngineLoad | None = None
        stat_loggers = None
        if os.environ.get("REFLOW_ENGINE_STATS", "1") != "0":
            self.load = EngineLoad(generated_tokens_total=0)
            stat_loggers = [_load_recorder(self.load)]
        from reflow.procs import ENGINE_PARENT_ENV, engine_process_affinity

        # The engine's processes end with this one, however it dies (procs.watch_parent).
        os.environ[ENGINE_PARENT_ENV] = str(os.getpid())
        with engine_process_affinity():
            self._engine = AsyncLLM.from_engine_args(args, stat_loggers=stat_loggers)
        self._sleep = EngineSleep(self._engine) if sleep_mode else None

    @property
    def kv_cache_tokens(self) -> int:
        """The KV cache's capacity in tokens (blocks x block size), as the engine
        sized it at start; 0 if it does not say. Budget_i of token-budget
        admission (paper §6.1)."""
        cache = getattr(getattr(self._engine, "vllm_config", None), "cache_config", None)
        blocks = getattr(cache, "num_gpu_blocks", None) or 0
        return int(blocks) * int(getattr(cache, "block_size", 0) or 0)

    async def generate(
        self, request_id: str, prompt_ids: list[int], sampling: SamplingSpec
    ) -> AsyncIterator[TokenDelta]:
        """One output, when the sample ends. vLLM labels every token with the
        weights that sampled it (`label_weights`), so the sample's version
        segments come with it and nothing is streamed per token: per-token deltas
        took a third of the rollout front end's CPU (bench/PROFILE.md)."""
        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        params = SamplingParams(
            max_tokens=sampling.max_tokens,
            min_tokens=sampling.min_tokens,
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            top_k=sampling.top_k,  # 0: off
            seed=sampling.seed,
            logprobs=0,
            detokenize=False,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        stream = self._engine.generate(TokensPrompt(prompt_token_ids=prompt_ids), params,
                                       request_id, lora_request=await self._adapter())
        async for out in stream:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            logprobs = [lp[tok].logprob for tok, lp in zip(ids, completion.logprobs or [])]
            yield TokenDelta(
                token_ids=ids,
                logprobs=logprobs,
                finished=out.finished,
                finish_reason=completion.finish_reason,
                segments=_segments(getattr(completion, "weight_versions", None), len(ids)),
            )

    async def _adapter(self):
        """The LoRARequest of a LoRA job's requests (None without LoRA), once the
        slot holds its zero adapter (made on first use: the engine's constructor
        cannot await the engine core)."""
        if self.lora is None:
            return None
        if not self._adapter_ready:
            import asyncio

            self._adapter_lock = self._adapter_lock or asyncio.Lock()
            async with self._adapter_lock:
                if not self._adapter_ready:
                    await self._engine.collective_rpc("reflow_init_adapter",
                                                      args=(self.lora.engine_slot_rank,))
                    self._adapter_ready = True
        from reflow.adapter_sync import lora_request

        return lora_request()

    async def score(self, token_ids: list[int]) -> list[float]:
        """log p(token t+1 | tokens ..t) under the loaded weights (and adapter) at
        temperature 1, for t = 0 .. len - 2: the engine's side of the weight-sync
        check (trainer/sync_check.py). One prefill, no sampled token kept. Empty
        from a sleeping engine (GPU standby), which cannot run a request."""
        import uuid

        from vllm import SamplingParams, TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        if self._sleep is not None and self._sleep.asleep:
            return []  # a sleeping standby engine runs nothing; checked once it wakes
        params = SamplingParams(max_tokens=1, temperature=1.0, prompt_logprobs=0,
                                detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        result = None
        async for out in self._engine.generate(
                TokensPrompt(prompt_token_ids=list(token_ids)), params,
                f"reflow-probe-{uuid.uuid4().hex}", lora_request=await self._adapter(),
                priority=PROBE_PRIORITY):
            result = out
        if result is None or result.prompt_logprobs is None:
            raise RuntimeError("the engine returned no prompt log-probabilities for the probe")
        return [float(lp[tok].logprob)
                for lp, tok in zip(result.prompt_logprobs[1:], token_ids[1:])]

    async def label_weights(self, policy_version: int) -> None:
        """Name the loaded weights: vLLM's engine core stamps each step's tokens
        with this label, between steps, so a token's label is exactly the weights
        that sampled it."""
        await self._engine.update_weight_version(str(policy_version))

    async def abort(self, request_id: str) -> None:
        await self._engine.abort(request_id)

    async def pause(self) -> None:
        """Returns once the engine has stopped at a step boundary. AsyncLLM's
        `pause_generation` then sleeps a fixed 20 ms so that outputs from before
        the pause reach their callers first; a sample here takes its versions
        from the engine's labels and reaches the worker whole, so that order does
        not matter and the pause goes to the engine core directly (the text-only
        engine has no multimodal cache for `pause_generation` to clear)."""
        pause_scheduler = getattr(getattr(self._engine, "engine_core", None),
                                  "pause_scheduler_async", None)
        if pause_scheduler is None:
            await self._engine.pause_generation(mode="keep", clear_cache=True)
        else:
            await pause_scheduler(mode="keep", clear_cache=True)

    async def resume(self) -> None:
        await self._engine.resume_generation()

    async def init_weight_sync(self, spec: WeightSyncSpec) -> None:
        """Every TP worker joins the group, each at spec.rank + its TP rank."""
        if spec.tensor_parallel_size != self.tensor_parallel_size:
            raise ValueError(f"tensor_parallel_size: {spec.tensor_parallel_size} is not this "
                             f"engine's ({self.tensor_parallel_size})")
        await self._engine.collective_rpc(
            "reflow_init_weight_sync",
            args=(
                spec.master_address,
                spec.master_port,
                spec.rank,
                spec.world_size,
                spec.backend,
                spec.tensors,
                spec.bucket_bytes,
                spec.tensor_parallel_size,
                spec.trainer_device_uuid,
                spec.rendezvous_key,
                self.lora.peft_config() if self.lora is not None else None,
            ),
        )
        await self._adapter()  # the slot exists before the first adapter arrives

    async def receive_weights(self) -> float:
        if self._sleep is not None:
            # A sleeping engine's weights are in host memory: back first, so the
            # broadcast loads into the tensors vLLM runs on.
            await self._sleep.weights_for_update()
        results = await self._engine.collective_rpc("reflow_receive_weights")
        return float(max(results))

    async def release_memory(self) -> dict[str, int]:
        """Standby (paper §5): give the KV cache's memory back. On CPU vLLM has no
        sleep mode (it logs and ignores `sleep`), so its workers drop the cache's
        pages (weightsync.worker_release_kv_cache); the prefix cache is reset first,
        since the cached blocks' contents go. Weights stay, so the engine keeps
        loading published versions and admits again without a reload. Returns
        bytes released and the engine process's resident memory before and after,
        summed over its workers. With sleep mode (a GPU engine of an elastic
        pool) the engine sleeps instead (memory.EngineSleep), and the figures are
        the GPU's free memory before and after."""
        if self._sleep is not None:
            import torch

            before = torch.cuda.mem_get_info()[0]
            await self._sleep.sleep()
            after = torch.cuda.mem_get_info()[0]
            return {"released": after - before, "rss_before": before, "rss_after": after}
        if not await self._engine.reset_prefix_cache():
            # A request still holds blocks: dropping their pages would corrupt it.
            raise RuntimeError("the engine still runs requests; its KV cache stays")
        results = await self._engine.collective_rpc("reflow_release_kv_cache")
        return {k: sum(int(r[k]) for r in results) for k in ("released", "rss_before", "rss_after")}

    async def restore_memory(self) -> None:
        """Leaving standby: a sleeping engine wakes (its KV cache, and its weights
        unless an update brought them back). CPU pages dropped by
        `release_memory` come back as the cache is written, so there is nothing
        to do there."""
        if self._sleep is not None:
            await self._sleep.wake()

    def shutdown(self) -> None:
        self._engine.shutdown()
