"""GPU memory of an AsyncHybrid worker (paper §5): the rollout engine and the
warm trainer half share one GPU, so the engine's share is sized with the
trainer's, and vLLM's sleep mode gives the KV cache back while the worker
holds the trainer role.

What each half holds, per GPU:

- the trainer's warm state, always: weights, gradients and AdamW's two moments
  (torch keeps them in the parameter's dtype: 4 x its bytes a parameter), a
  frozen reference copy with `trainer.kl_coef > 0`, all divided by the ranks
  under `trainer.parallelism: fsdp`;
- the engine's weights, always (a sleeping engine's come back for each weight
  update: `EngineSleep.weights_for_update`);
- the engine's KV cache in the rollout role, the trainer's activations in the
  trainer role: the two never coexist, so the activations must fit in the
  space the KV cache gives back.

Pure sizing and call order: no vLLM, torch or CUDA import, so a CPU test
checks both (tests/unit/test_engine_memory.py).
"""

from __future__ import annotations

import json
import struct
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# CUDA context, NCCL's buffers, the caching allocator's fragmentation: kept out of
# both halves (vLLM's own default, 0.9 utilisation, keeps 10 %).
HEADROOM_FRACTION = 0.05
# Activation bytes per token, hidden unit and layer of a decoder block in 16-bit
# training without recomputation (Korthikanti et al. 2022, 34sbh per layer, without
# the attention scores FlashAttention never stores) and with it (2sbh: the block's
# input only).
ACTIVATION_BYTES_PER_TOKEN_UNIT = 34
CHECKPOINTED_BYTES_PER_TOKEN_UNIT = 2
_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
_SAFETENSORS_DTYPE_BYTES = {"F64": 8, "F32": 4, "BF16": 2, "F16": 2, "I64": 8, "I32": 4,
                            "I16": 2, "I8": 1, "U8": 1, "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}
# A safetensors header larger than this is not a model's.
_MAX_HEADER_BYTES = 100 * 2**20


@dataclass(frozen=True)
class ModelShape:
    """What the sizing needs of a checkpoint: its parameter count and the
    hidden size and depth that scale its activations."""

    parameters: int
    hidden_size: int
    num_layers: int

    @classmethod
    def read(cls, model_dir: str | Path) -> ModelShape:
        """From the directory's config.json and the safetensors headers (the
        first 8 bytes and a JSON table of shapes; no tensor is read)."""
        root = Path(model_dir)
        config = json.loads((root / "config.json").read_text())
        text = config.get("text_config", config)
        hidden, layers = text.get("hidden_size"), text.get("num_hidden_layers")
        if not isinstance(hidden, int) or not isinstance(layers, int):
            raise ValueError(f"{root}/config.json: no integer hidden_size and "
                             "num_hidden_layers to size the trainer's activations by")
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise ValueError(f"{root}: no *.safetensors to count the parameters of")
        return cls(sum(_safetensors_parameters(f) for f in files), hidden, layers)


def _safetensors_parameters(path: Path) -> int:
    """Elements of every tensor a safetensors file lists; ValueError naming the
    file for one that is not a safetensors file (its header is read, bounded,
    and checked before use)."""
    with path.open("rb") as f:
        head = f.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else 0
        if not 0 < size <= _MAX_HEADER_BYTES:
            raise ValueError(f"{path}: not a safetensors file (a {size}-byte header)")
        raw = f.read(size)
    try:
        header = json.loads(raw)
        total = 0
        for name, entry in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in entry["shape"]:
                if not isinstance(dim, int) or dim < 0:
                    raise ValueError(f"tensor {name[:80]!r}: shape {entry['shape']!r}")
                count *= dim
            total += count
    except (ValueError, KeyError, TypeError, AttributeError) as err:
        raise ValueError(f"{path}: not a safetensors header ({err})"[:500]) from None
    return total


@dataclass(frozen=True)
class MemoryPlan:
    """One GPU of an AsyncHybrid worker, in bytes. `engine_utilization` is
    vLLM's `gpu_memory_utilization`: the engine's weights and KV cache (and
    its few activations) over the GPU's total."""

    total: int
    headroom: int
    trainer_state: int
    trainer_activations: int
    engine_weights: int
    kv_cache: int
    engine_utilization: float
    sleep_mode: bool

    def as_record(self) -> dict:
        return {k: (round(v / 2**30, 3) if isinstance(v, int) and not isinstance(v, bool)
                    else v) for k, v in asdict(self).items()}


def trainer_state_bytes(shape: ModelShape, dtype: str, ranks: int, sharded: bool,
                        reference: bool) -> int:
    """Weights, gradients and AdamW's two moments (and the KL reference), this
    GPU's part of them: 1/ranks each under FSDP."""
    per_parameter = (4 + (1 if reference else 0)) * _DTYPE_BYTES[dtype]
    whole = shape.parameters * per_parameter
    return -(-whole // ranks) if sharded else whole


def activation_bytes(shape: ModelShape, micro_batch_tokens: int, checkpointed: bool) -> int:
    per = CHECKPOINTED_BYTES_PER_TOKEN_UNIT if checkpointed else ACTIVATION_BYTES_PER_TOKEN_UNIT
    return per * micro_batch_tokens * shape.hidden_size * shape.num_layers


def plan_hybrid_gpu(total_bytes: int, shape: ModelShape, spec, ranks: int = 1,
                    sharded: bool = False) -> MemoryPlan:
    """The engine's share of a GPU that also holds a warm trainer replica (an
    elastic pool's worker). `spec.rollout.gpu_memory_utilization`, when set, is
    checked against what the trainer half needs; unset, the engine gets all the
    trainer leaves. With `rollout.sleep_mode: off` the trainer's activations
    are kept out of the engine's share too, since its KV cache stays. Raises
    ValueError naming the field to change when the two halves do not fit."""
    sleep = spec.rollout.sleep_mode == "auto"
    dtype = spec.model.dtype
    headroom = int(total_bytes * HEADROOM_FRACTION)
    state = trainer_state_bytes(shape, dtype, ranks, sharded, spec.trainer.kl_coef > 0)
    tokens = spec.trainer.max_tokens_per_micro_batch or (
        spec.trainer.batch_size * (spec.rollout.longest_response + 2048))
    activations = activation_bytes(shape, tokens, spec.trainer.activation_checkpointing)
    weights = shape.parameters * _DTYPE_BYTES[dtype]
    chosen = spec.rollout.gpu_memory_utilization
    beside = state if sleep else state + activations
    engine = int(total_bytes * chosen) if chosen is not None else (
        total_bytes - headroom - beside)
    kv_cache = engine - weights
    gib = 2**30
    if kv_cache <= 0 or headroom + beside + engine > total_bytes:
        raise ValueError(
            f"rollout.gpu_memory_utilization: the trainer half's warm state "
            f"({state / gib:.1f} GiB: weights, gradients, AdamW) and the engine's weights "
            f"({weights / gib:.1f} GiB)" + ("" if sleep else
                                          f" and activations ({activations / gib:.1f} GiB)")
            + f" leave no KV cache on a {total_bytes / gib:.1f} GiB GPU"
            + (f" at {chosen}" if chosen is not None else "")
            + "; use model.dtype: bfloat16, a smaller model, or leave "
            "rollout.gpu_memory_utilization unset")
    if sleep and activations > kv_cache:
        raise ValueError(
            f"trainer.max_tokens_per_micro_batch: {tokens} tokens' activations "
            f"(~{activations / gib:.1f} GiB) do not fit in the {kv_cache / gib:.1f} GiB the "
            "sleeping engine's KV cache gives back; lower it or set "
            "trainer.activation_checkpointing: true")
    return MemoryPlan(total_bytes, headroom, state, activations, weights, kv_cache,
                      round(engine / total_bytes, 4), sleep_mode=sleep)


class EngineSleep:
    """vLLM's sleep mode around standby, on an AsyncLLM-like `engine`
    (`sleep(level)`, `wake_up(tags)`, `reset_prefix_cache()`, all awaited).

    Standby puts the whole engine to sleep at level 1: the KV cache is
    dropped and the weights move to host memory, so the GPU is the trainer's.
    A weight update while asleep brings the weights back first (`wake_up(
    tags=["weights"])`): the broadcast lands in the engine's own tensors, and
    the weights stay on the GPU (the plan counts them there); the KV cache
    stays released until the worker leaves standby (`wake`)."""

    LEVEL = 1

    def __init__(self, engine) -> None:
        self.engine = engine
        self.asleep_tags: set[str] = set()
        self.timings: dict[str, float] = {}

    @property
    def asleep(self) -> bool:
        return bool(self.asleep_tags)

    async def sleep(self) -> None:
        if self.asleep:
            return
        if not await self.engine.reset_prefix_cache():
            # A request still holds blocks: sleeping would abort it.
            raise RuntimeError("the engine still runs requests; it stays awake")
        started = time.monotonic()
        await self.engine.sleep(level=self.LEVEL)
        self.asleep_tags = {"weights", "kv_cache"}
        self.timings["sleep_s"] = time.monotonic() - started

    async def weights_for_update(self) -> None:
        """Before a weight broadcast: a sleeping engine's weights on the GPU."""
        if "weights" not in self.asleep_tags:
            return
        started = time.monotonic()
        await self.engine.wake_up(tags=["weights"])
        self.asleep_tags.discard("weights")
        self.timings["wake_weights_s"] = time.monotonic() - started

    async def wake(self) -> None:
        """Leaving standby: whatever still sleeps comes back."""
        if not self.asleep:
            return
        started = time.monotonic()
        tags = sorted(self.asleep_tags)
        await self.engine.wake_up(tags=None if len(tags) == 2 else tags)
        self.asleep_tags.clear()
        self.timings["wake_s"] = time.monotonic() - started
