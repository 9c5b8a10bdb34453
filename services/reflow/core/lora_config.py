"""The job spec's `lora` section: train low-rank adapters instead of the weights.

With it the trainer wraps the policy in PEFT adapters (trainer/lora.py), its
optimizer holds only their parameters, and each weight sync (paper §4.1 step 4)
moves only the adapter tensors into the engines' LoRA slot (weightsync.py).
"""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, StringConstraints, field_validator

from reflow.core.sections import _Section

# The ranks vLLM sizes its LoRA slots for (vllm.config.lora.MaxLoRARanks); an
# adapter of rank r runs in the smallest slot of at least r.
ENGINE_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# The decoder blocks' projections of Llama/Qwen-style models: every linear layer
# vLLM can put an adapter on for those architectures.
DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                          "down_proj")

ModuleName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]


class LoraConfig(_Section):
    """Low-rank adapters (LoRA: W + (alpha / r) B A, with B = 0 at the start, so
    policy version 0 is the base model)."""

    rank: int = Field(
        default=16, ge=1, le=ENGINE_LORA_RANKS[-1],
        description="r: the rank of every adapter. The engine runs it in the smallest of "
        "vLLM's LoRA slot sizes (1, 8, 16, 32, 64, 128, 256, 320, 512) of at least r.")
    alpha: float = Field(
        default=32.0, gt=0.0, le=65_536.0,
        description="α: the adapter's output is scaled by α / r.")
    dropout: float = Field(
        default=0.0, ge=0.0, lt=1.0,
        description="Dropout on the adapter's input while training (PEFT's lora_dropout). "
        "The trainer scores tokens without it (the engine samples without it), so it "
        "applies to the loss's gradient path only.")
    target_modules: list[ModuleName] = Field(
        default_factory=lambda: list(DEFAULT_TARGET_MODULES), min_length=1, max_length=32,
        description="Names of the linear layers that get an adapter, as the last part of "
        "their module path (`q_proj` matches every block's attention query projection). "
        "Checked against the model's layers when the trainer loads it: a name that matches "
        "no linear layer of a decoder block fails the job, listing the names it has. The "
        "embedding and the LM head cannot take one.")

    @field_validator("target_modules")
    @classmethod
    def _distinct(cls, names: list[str]) -> list[str]:
        seen = set()
        for name in names:
            if name in seen:
                raise ValueError(f"lora.target_modules: {name!r} is listed twice")
            if name in ("lm_head", "embed_tokens"):
                raise ValueError(f"lora.target_modules: {name!r} cannot take an adapter (the "
                                 "engine's LoRA covers the decoder blocks' linear layers); "
                                 "remove it")
            seen.add(name)
        return names

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    @property
    def engine_slot_rank(self) -> int:
        """The engine's max_lora_rank for this adapter."""
        return next(r for r in ENGINE_LORA_RANKS if r >= self.rank)

    def peft_config(self) -> dict:
        """The adapter_config.json fields PEFT and vLLM read (PEFTHelper)."""
        return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": self.rank,
                "lora_alpha": self.alpha, "lora_dropout": self.dropout,
                "target_modules": list(self.target_modules), "bias": "none"}
