"""LoRA in the trainer: PEFT adapters on the frozen policy, the tensors a weight
sync moves, and the final export as an adapter and as a merged model.

`apply_lora` injects PEFT's LoRA layers into the Hugging Face model in place,
so the trainer keeps training, sharding and checkpointing that same module:
only its trainable parameters change (the adapters'), and every place that
builds an optimizer or saves state takes the trainable ones. A weight sync
(paper §4.1 step 4) sends the adapter tensors alone, under PEFT's file names
(`base_model.model.<module>.lora_A.weight`), which vLLM's LoRA loader parses;
the engine keeps its base weights from model.path (weightsync.py).
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import torch

from reflow.core.lora_config import LoraConfig

logger = logging.getLogger(__name__)

# The adapter PEFT injects, by its default name; the one adapter a job trains.
ADAPTER_NAME = "default"
PEFT_PREFIX = "base_model.model."
# PEFT's parameter of a LoRA layer: <module>.lora_A.default.weight.
_ADAPTER_PARAM = re.compile(rf"^(?P<module>.+)\.lora_(?P<ab>[AB])\.{ADAPTER_NAME}\.weight$")
# Where the final export puts the adapter, under the merged model's directory.
ADAPTER_DIR = "adapter"


def block_linear_names(model: torch.nn.Module) -> set[str]:
    """The last name of every linear layer inside the model's decoder blocks (the
    layers an adapter can go on: q_proj, down_proj, ...)."""
    names = set()
    for path, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in f".{path}":
            names.add(path.rsplit(".", 1)[-1])
    return names


def check_target_modules(model: torch.nn.Module, cfg: LoraConfig) -> None:
    """ValueError naming lora.target_modules when one of them matches no linear
    layer of a decoder block of this model."""
    have = block_linear_names(model)
    missing = [name for name in cfg.target_modules if name not in have]
    if missing:
        raise ValueError(f"lora.target_modules: {', '.join(map(repr, missing))} match no linear "
                         f"layer in the decoder blocks of {type(model).__name__}; its linear "
                         f"layers are {', '.join(sorted(have)) or 'none'}")


def apply_lora(model: torch.nn.Module, cfg: LoraConfig):
    """Inject the adapters into `model` in place (B = 0, so the model's outputs
    are unchanged) and freeze everything else. Returns PEFT's wrapper, which
    shares `model`'s modules; the trainer goes on training `model` itself."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    check_target_modules(model, cfg)
    peft_model = get_peft_model(model, PeftLoraConfig(
        r=cfg.rank, lora_alpha=cfg.alpha, lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules), bias="none", task_type="CAUSAL_LM"),
        adapter_name=ADAPTER_NAME)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    total = sum(p.numel() for p in model.parameters())
    logger.info("lora: rank %d on %s: %d trainable parameters of %d (%.2f%%)", cfg.rank,
                ",".join(cfg.target_modules), trainable, total, 100.0 * trainable / total)
    return peft_model


def has_lora(model: torch.nn.Module) -> bool:
    return any(_ADAPTER_PARAM.match(name) for name, _ in model.named_parameters())


def peft_name(name: str) -> str | None:
    """PEFT's file name of an adapter parameter of the injected model (None for
    any other parameter): `model.layers.0.self_attn.q_proj.lora_A.default.weight`
    -> `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`."""
    m = _ADAPTER_PARAM.match(name.removeprefix("_fsdp_wrapped_module."))
    if m is None:
        return None
    return f"{PEFT_PREFIX}{m['module']}.lora_{m['ab']}.weight"


def synced_parameters(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """What a weight sync sends, in a fixed order: with adapters, only theirs, under
    PEFT's names; without, every parameter under the model's names, a tied weight
    once (named_parameters() lists a tied lm_head under the embedding's name, which
    is what the engines' checkpoint loaders expect)."""
    named, seen = [], set()
    adapters = [(peft_name(n), p) for n, p in model.named_parameters()]
    adapters = [(n, p) for n, p in adapters if n is not None]
    if adapters:
        return adapters
    for name, p in model.named_parameters():
        if id(p) not in seen:
            seen.add(id(p))
            named.append((name, p))
    return named


def adapter_state(full_state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a state dict of the injected model, under PEFT's
    names (what adapter_model.safetensors holds)."""
    return {peft: t for name, t in full_state.items() if (peft := peft_name(name)) is not None}


def merged_state(full_state: dict[str, torch.Tensor], cfg: LoraConfig
                 ) -> dict[str, torch.Tensor]:
    """The model's own state dict with every adapter folded into its layer:
    W' = W + (α / r) B A, under the base model's names (`<module>.weight`), as
    PEFT's merge_and_unload computes it. Works on a gathered FSDP state as well
    as on a replicated model's."""
    merged: dict[str, torch.Tensor] = {}
    lora: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in full_state.items():
        m = _ADAPTER_PARAM.match(name)
        if m is not None:
            lora.setdefault(m["module"], {})[m["ab"]] = tensor
        elif ".lora_" in name:
            continue  # dropout and other adapter modules hold no weights of the model
        else:
            merged[name.replace(".base_layer.", ".")] = tensor
    for module, ab in lora.items():
        key = f"{module}.weight"
        base = merged[key]
        delta = (ab["B"].float() @ ab["A"].float()) * cfg.scaling
        merged[key] = (base.float() + delta).to(base.dtype)
    return merged


def export_lora(model: torch.nn.Module, tokenizer, path: Path, cfg: LoraConfig,
                full_state: dict[str, torch.Tensor] | None = None,
                base_model_path: str = "") -> None:
    """The final export of a LoRA job: the merged Hugging Face model at `path`
    (loads with from_pretrained like any checkpoint, and in vLLM without LoRA)
    and the adapter in PEFT's format at `path`/adapter (adapter_config.json and
    adapter_model.safetensors; PeftModel.from_pretrained on the base model, or a
    vLLM LoRARequest). `full_state`: the injected model's whole state (gathered
    from FSDP shards); None takes `model`'s."""
    from safetensors.torch import save_file

    state = full_state if full_state is not None else {
        k: v.detach() for k, v in model.state_dict().items()}
    path = Path(path)
    adapter_dir = path / ADAPTER_DIR
    adapter_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous().cpu() for k, v in adapter_state(state).items()},
              str(adapter_dir / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = dict(cfg.peft_config(), base_model_name_or_path=base_model_path)
    (adapter_dir / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    merged = merged_state(state, cfg)
    # save_pretrained of the model itself writes its config and drops a tied
    # lm_head as for any export; the state given is the merged one.
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    base.save_pretrained(path, state_dict=merged, safe_serialization=True)
    tokenizer.save_pretrained(path)
