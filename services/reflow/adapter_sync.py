"""Adapter-only weight sync into vLLM's LoRA slot (paper §4.1 step 4 with LoRA).

A LoRA job's engine keeps the base weights it loaded from model.path and runs
every request under one adapter id, `ADAPTER_ID`: a zero adapter from the
start (B = 0, so version 0 is the base model, as the trainer's freshly
injected adapters are), replaced in place by each published version. The
tensors come over the same broadcast group, bucket plan and versioning as full
weights (weightsync.py); here they become a vLLM `LoRAModel` built from memory
and swapped into the slot under the same id, between two engine steps.

Partial rollout with adapters: a request in flight across a sync continues
under the new adapter, as it does under new full weights (ReFlow's partial
rollout, paper §4.1), so a token's policy version is the adapter that sampled
it and staleness is counted per token exactly as without LoRA. The other
choice, TRL's, keeps δ + 1 adapter versions resident so that each request
finishes on the adapter it started with; that makes a sample's staleness its
start version's and costs δ + 1 slots in the LoRA kernels (bench/lora.py
measures the decode cost of resident adapters).

Nothing goes through vLLM's file loader: a `LoRARequest` whose id is loaded is
only activated (WorkerLoRAManager.add_adapter), so the request's path is never
read. Were the slot ever emptied, the next request would fail loudly on that
path instead of silently running the base model.
"""

from __future__ import annotations

import time

import torch

# The one adapter id a LoRA job's requests carry, and its name.
ADAPTER_ID = 1
ADAPTER_NAME = "reflow-policy"
# Never read (see above); named so that a failed lookup says what it was.
ADAPTER_PATH = "/reflow/adapter-from-weight-sync"


def lora_request():
    """The LoRARequest every request of a LoRA job carries."""
    from vllm.lora.request import LoRARequest

    return LoRARequest(ADAPTER_NAME, ADAPTER_ID, ADAPTER_PATH)


def _manager(worker):
    manager = getattr(worker.model_runner, "lora_manager", None)
    if manager is None:
        raise RuntimeError("this vLLM engine was started without LoRA (enable_lora); a LoRA "
                           "job's engine needs it")
    return manager


def worker_init_adapter(worker, rank: int) -> bool:
    """At engine start: a zero adapter of `rank` under ADAPTER_ID, so every
    request runs under the adapter slot from its first token (version 0 is the
    base model). A request that started before the first sync then continues
    under the published adapter like any other."""
    manager = _manager(worker)
    if ADAPTER_ID in manager.list_adapters():
        return False
    return bool(manager.add_dummy_lora(lora_request(), rank=rank))


def worker_load_adapter(worker, tensors: dict[str, torch.Tensor], peft_config: dict) -> int:
    """Replace the slot's adapter with `tensors` (PEFT names: base_model.model.
    <module>.lora_A.weight, ...) under `peft_config` (r, lora_alpha,
    target_modules). Returns how many layers the adapter covers. Refuses an
    adapter that covers none of the model's LoRA layers, the sign of names that
    did not map."""
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    manager = _manager(worker)
    adapters = manager._adapter_manager
    helper = PEFTHelper.from_dict(dict(peft_config,
                                       vllm_max_position_embeddings=manager.max_position_embeddings))
    helper.validate_legal(manager.lora_config)
    model = adapters.model
    mapper = getattr(model, "hf_to_vllm_mapper", None)
    lora = LoRAModel.from_lora_tensors(
        ADAPTER_ID, tensors, helper, device="cpu", dtype=manager.lora_config.lora_dtype,
        model_vocab_size=manager.vocab_size,
        weights_mapper=mapper.get_rename_mapper() if mapper is not None else None,
        skip_prefixes=getattr(model, "lora_skip_prefixes", None))
    if not lora.loras:
        raise ValueError(f"the adapter's {len(tensors)} tensors name none of this model's LoRA "
                         f"layers (first: {next(iter(tensors), '')!r})")
    # One engine step never sees half of it: this runs on the engine core between steps.
    adapters.remove_adapter(ADAPTER_ID)
    adapters.add_adapter(lora)
    adapters.activate_adapter(ADAPTER_ID)
    return len(lora.loras)


def worker_receive_adapter(worker, state: dict) -> float:
    """Receive one broadcast of the adapter tensors and swap them into the slot;
    seconds taken. A broadcast cut off part-way raises before anything loads,
    so the slot keeps the last whole version."""
    from reflow.weightsync import receive_weights

    start = time.perf_counter()
    device = getattr(worker.model_runner, "device", None) or torch.device("cpu")
    tensors = {name: tensor for name, tensor in
               receive_weights(state["group"], state["specs"], state["bucket_bytes"], device)}
    worker_load_adapter(worker, tensors, state["lora"])
    return time.perf_counter() - start
