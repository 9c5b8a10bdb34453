"""LoRA in the trainer (trainer/lora.py) on the tiny model, without services: the
spec section, the adapters PEFT injects, what a sync sends, the checkpoint a
resumed trainer continues from, and the final export."""

from __future__ import annotations

import json
import random

import pytest
import torch

from reflow.core.config import JobSpecError, parse_job_spec
from reflow.core.lora_config import LoraConfig
from reflow.core.types import Batch, Segment, Trajectory
from reflow.trainer.checkpoint import Checkpointer, load_checkpoint, read_checkpoint
from reflow.trainer.lora import (block_linear_names, export_lora, merged_state, peft_name,
                                 synced_parameters)
from reflow.trainer.loop import TrainLoop


class _NoReplay:
    def configure(self, job_id, config):
        pass


def _spec(model_path: str, **lora):
    return parse_job_spec({
        "name": "lora", "model": {"path": model_path},
        "trainer": {"batch_size": 8, "learning_rate": 0.01},
        "lora": {"rank": 4, "alpha": 8, **lora}})


def _loop(spec) -> TrainLoop:
    loop = TrainLoop("lora", spec, _NoReplay(), rollouts=[], device=torch.device("cpu"))
    loop.load()
    return loop


def _batch(vocab: int, seed: int) -> Batch:
    rng = random.Random(seed)
    trajectories = [Trajectory(
        sample_id=f"s{i}", group_id=f"g{i // 4}", prompt_ids=[rng.randrange(vocab) for _ in range(5)],
        response_ids=[rng.randrange(vocab) for _ in range(n)], logprobs=[-3.0] * n,
        loss_mask=[1] * n, segments=[Segment(0, n)], advantage=rng.uniform(-1, 1))
        for i, n in enumerate([4, 7, 3, 9, 5, 6, 8, 2])]
    return Batch(lease_id="t", trajectories=trajectories)


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].float()


def test_the_lora_section_validates_at_the_edge_naming_the_field(tiny_model):
    spec = parse_job_spec({"model": {"path": tiny_model}, "lora": {}})
    assert spec.lora.rank == 16 and spec.lora.alpha == 32.0 and spec.lora.dropout == 0.0
    assert "q_proj" in spec.lora.target_modules and spec.lora.scaling == 2.0
    assert parse_job_spec({"model": {"path": tiny_model}}).lora is None
    assert LoraConfig(rank=12).engine_slot_rank == 16 and LoraConfig(rank=1).engine_slot_rank == 1
    for bad, needle in [({"rank": 0}, "lora.rank"), ({"rank": 513}, "lora.rank"),
                        ({"dropout": 1.0}, "lora.dropout"), ({"alpha": 0}, "lora.alpha"),
                        ({"target_modules": ["lm_head"]}, "lora.target_modules: 'lm_head'"),
                        ({"target_modules": ["q_proj", "q_proj"]}, "listed twice"),
                        ({"target_modules": ["model.layers.0"]}, "lora.target_modules"),
                        ({"target_modules": []}, "lora.target_modules"),
                        ({"ranks": 4}, "lora.ranks: unknown field")]:
        with pytest.raises(JobSpecError, match=needle.replace(".", r"\.")):
            parse_job_spec({"model": {"path": tiny_model}, "lora": bad})


def test_a_target_the_model_lacks_fails_at_load_listing_the_layers_it_has(tiny_model):
    with pytest.raises(ValueError, match=r"lora\.target_modules: 'c_attn' match no linear layer"
                       r".*down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj"):
        _loop(_spec(tiny_model, target_modules=["q_proj", "c_attn"]))


def test_adapters_start_as_the_base_model_and_only_they_train_and_sync(tiny_model):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model)
    loop = _loop(_spec(tiny_model))
    ids = [3, 5, 7, 9, 11, 13]
    # B = 0: version 0 of a LoRA job is the base model, which the engines start from.
    assert torch.equal(_logits(loop.model, ids), _logits(base, ids))
    trainable = {n for n, p in loop.model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable)
    optimized = [p for g in loop.optimizer.param_groups for p in g["params"]]
    assert len(optimized) == len(trainable)
    layers = base.config.num_hidden_layers
    named = synced_parameters(loop.model)
    assert len(named) == 2 * 7 * layers  # A and B of 7 projections per block
    assert all(n.startswith("base_model.model.model.layers.") and n.endswith(
        (".lora_A.weight", ".lora_B.weight")) for n, _ in named)
    assert {n for n, _ in named} == {peft_name(n) for n in trainable}
    # Without LoRA a sync sends every weight once (the tied head under the embedding).
    full = synced_parameters(base)
    assert len(full) == len({id(p) for p in base.parameters()})
    assert sum(p.numel() for _, p in named) < 0.1 * sum(p.numel() for _, p in full)
    assert block_linear_names(base) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj",
                                        "up_proj", "down_proj"}
    # A step moves the adapters, never the base weights.
    before = {n: p.detach().clone() for n, p in loop.model.named_parameters()}
    loop._train_step(_batch(base.config.vocab_size, 0))
    after = dict(loop.model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n])}
    assert moved and moved <= trainable
    assert not torch.equal(_logits(loop.model, ids), _logits(base, ids))


def test_a_resumed_lora_trainer_continues_exactly_where_the_checkpoint_was(tiny_model, tmp_path):
    spec = _spec(tiny_model, target_modules=["q_proj", "v_proj", "down_proj"])
    first = _loop(spec)
    vocab = first.model.config.vocab_size
    for seed in range(3):
        first._train_step(_batch(vocab, seed))
    saver = Checkpointer(tmp_path, interval=1, keep_last=2)
    saver.save(3, 3, first.model, first.optimizer, {})
    path = saver.wait(60)
    # The checkpoint holds the adapters and their AdamW moments, not the frozen base.
    saved = sum(f.stat().st_size for f in path.rglob("*") if f.is_file())
    base_bytes = sum(p.numel() * p.element_size() for p in first.model.parameters()
                     if not p.requires_grad)
    assert saved < base_bytes / 4, (saved, base_bytes)

    resumed = _loop(spec)
    load_checkpoint(read_checkpoint(path), resumed.model, resumed.optimizer)
    for (name, a), (_, b) in zip(first.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.equal(a, b), name
    # The next step from either is the same step: the curve goes on, not back to B = 0.
    torch.manual_seed(5)
    first._train_step(_batch(vocab, 9))
    torch.manual_seed(5)
    resumed._train_step(_batch(vocab, 9))
    for (name, a), (_, b) in zip(first.model.named_parameters(), resumed.model.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_the_export_is_a_peft_adapter_and_a_merged_model_with_the_same_outputs(
        tiny_model, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    loop = _loop(_spec(tiny_model))
    vocab = loop.model.config.vocab_size
    for seed in range(2):
        loop._train_step(_batch(vocab, seed))
    loop.model.eval()
    ids = [2, 4, 6, 8, 10, 12, 14]
    trained = _logits(loop.model, ids)
    out = tmp_path / "export"
    export_lora(loop.model, loop.tokenizer, out, loop.spec.lora, base_model_path=tiny_model)

    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_logits(merged, ids), trained, atol=1e-4)
    config = json.loads((out / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8.0
    assert config["base_model_name_or_path"] == tiny_model
    adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model),
                                        out / "adapter")
    assert torch.allclose(_logits(adapter, ids), trained, atol=1e-5)
    # merged_state is PEFT's own merge.
    ours = merged_state({k: v.detach() for k, v in loop.model.state_dict().items()},
                        loop.spec.lora)
    theirs = adapter.merge_and_unload().state_dict()
    for name, tensor in theirs.items():
        assert torch.allclose(ours[name], tensor, atol=1e-6), name
