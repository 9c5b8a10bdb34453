"""What a simulated job's weight syncs and role flips move: the whole model
under full fine-tuning, only the LoRA adapters with the job's `lora` section
(core/lora_config.py).

With LoRA the trainer trains PEFT adapters on a frozen model: each weight sync
(paper §4.1 step 4) sends, for every target linear layer of every decoder
block, lora_A (r x in_features) and lora_B (out_features x r) in the model's
dtype, and AdamW holds moments for those alone. A role flip (paper §5) moves
trainer state, the trained parameters and their two moments; the frozen base is
already on every worker (its engine serves it, its warm trainer replica holds
it), so with LoRA a flip moves the adapter's state.

Prices, not mechanisms: the sync is SyncCost's overhead plus the bytes over its
bandwidth; a flip is FlipCost's measured (full fine-tuning) pause with its
state transfer repriced. What LoRA does to the engines' decode step (the
adapter's extra matmuls) and to training FLOPs is not modelled here.
"""

from __future__ import annotations

from dataclasses import dataclass

from reflow.core.config import JobSpec
from reflow.core.lora_config import LoraConfig
from reflow.sim.costs import CostModel, ModelShape

# AdamW's two moments beside each trained parameter, in its dtype (trainer/reshard.py
# moves the same three tensors at a flip).
STATE_TENSORS_PER_PARAMETER = 3
# trainer.parallelism: auto shards models of this many parameters or more (the
# trainer's rule, trainer/fsdp.py); a simulated reflow pool may always flip roles.
FSDP_AUTO_MIN_PARAMETERS = 1e9


def projection_features(shape: ModelShape) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each linear layer of a Llama/Qwen-style
    decoder block, by its module name."""
    h, attention = shape.hidden_size, shape.num_heads * shape.head_dim
    kv, mlp = shape.num_kv_heads * shape.head_dim, shape.intermediate_size
    return {"q_proj": (h, attention), "k_proj": (h, kv), "v_proj": (h, kv),
            "o_proj": (attention, h), "gate_proj": (h, mlp), "up_proj": (h, mlp),
            "down_proj": (mlp, h)}


def adapter_parameters(shape: ModelShape, lora: LoraConfig) -> int:
    """Parameters of the adapters `lora` puts on a model of `shape`: r x (in + out)
    for each target layer (lora_A and lora_B), in every decoder block. ValueError
    naming lora.target_modules for a name the shape has no layer of."""
    features = projection_features(shape)
    unknown = [m for m in lora.target_modules if m not in features]
    if unknown:
        raise ValueError(f"lora.target_modules: the simulator knows no layer {unknown[0]!r}; "
                         f"it sizes adapters on {', '.join(features)}")
    per_block = sum(lora.rank * sum(features[m]) for m in lora.target_modules)
    return per_block * shape.num_layers


def _sharded(spec: JobSpec, parameters: float) -> bool:
    """Whether the trainer group holds its state in shards (trainer.parallelism)."""
    if spec.trainer.parallelism != "auto":
        return spec.trainer.parallelism == "fsdp"
    return parameters >= FSDP_AUTO_MIN_PARAMETERS


@dataclass(frozen=True)
class Transfers:
    """The bytes a simulated job moves, and what they cost."""

    costs: CostModel
    sync_bytes: float
    """A weight sync's bytes: the model's weights, or the adapters."""
    state_bytes: float
    """The trainer state a flip moves shards of: trained parameters and AdamW moments."""
    full_state_bytes: float
    """The same under full fine-tuning, which FlipCost's measured pauses moved."""
    sharded: bool
    lora: bool

    @property
    def sync_s(self) -> float:
        sync = self.costs.sync
        return sync.overhead_s + self.sync_bytes / sync.bandwidth_bytes_per_s

    def _state_s(self, state_bytes: float, grew: bool, ranks_before: int,
                 ranks_after: int) -> float:
        """Seconds a flip spends moving `state_bytes` of trainer state. Sharded
        (paper §5): each joiner receives, or the leaver hands over, one shard of
        the larger group, all in parallel. Replicated: a joiner receives the whole
        state; a leaver hands over nothing (every member keeps a copy)."""
        if self.sharded:
            moved = state_bytes / max(1, ranks_before, ranks_after)
        else:
            moved = state_bytes if grew else 0.0
        return moved / self.costs.flip.state_bandwidth_bytes_per_s

    def flip_pause_s(self, grew: bool, ranks_before: int, ranks_after: int) -> float:
        """The trainer's pause for a membership change at a sync boundary:
        FlipCost's measured pause, whose state transfer, with LoRA, is the adapter's."""
        flip = self.costs.flip
        measured = flip.to_trainer_s if grew else flip.to_rollout_s
        if not self.lora:
            return measured
        fixed = max(0.0, measured - self._state_s(self.full_state_bytes, grew, ranks_before,
                                                  ranks_after))
        return fixed + self._state_s(self.state_bytes, grew, ranks_before, ranks_after)


def transfers(costs: CostModel, spec: JobSpec) -> Transfers:
    """The job's transfers under `costs`. The adapters are in the model's dtype,
    whose bytes a parameter the cost model states as sync.weight_bytes over
    train.parameters."""
    weights, parameters = costs.sync.weight_bytes, costs.train.parameters
    full_state = STATE_TENSORS_PER_PARAMETER * weights
    sharded = _sharded(spec, parameters)
    if spec.lora is None:
        return Transfers(costs, weights, full_state, full_state, sharded, lora=False)
    adapter = adapter_parameters(costs.model, spec.lora) * weights / parameters
    return Transfers(costs, adapter, STATE_TENSORS_PER_PARAMETER * adapter, full_state,
                     sharded, lora=True)
