"""The stop tokens a model directory's engine suppresses under `min_tokens`.

vLLM (0.32) masks, at every position under a request's min_tokens, the logits
of `SamplingParams.all_stop_token_ids`: the tokenizer's eos_token_id, every id
of the generation config's eos_token_id (generation_config.json, or config.json
where that file is absent), and the request's own stop_token_ids (ReFlow sends
none). The sampled token's logprob at such a position is then
log_softmax(logits / T) over the vocabulary less these ids (processed
logprobs, rollout/vllm_engine.py), so a trainer that scores those positions
masks the same ids (core.types.Trajectory.min_tokens).

This module reads a directory; it knows nothing of engines or training.
"""

from __future__ import annotations

import os

from reflow.models import import_transformers


def stop_token_ids(model_dir: str | os.PathLike[str]) -> list[int]:
    """The ids vLLM treats as stops for the model at `model_dir`, sorted."""
    import_transformers()  # the first import of it under a lock (reflow.models)
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    ids: set[int] = set()
    tokenizer = AutoTokenizer.from_pretrained(  # nosec B615 # a local dir only
        model_dir, local_files_only=True)
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    # vLLM's try_get_generation_config: the generation config, else one derived
    # from the model's config.
    try:
        generation = GenerationConfig.from_pretrained(  # nosec B615 # a local dir only
            model_dir, local_files_only=True)
    except OSError:
        generation = GenerationConfig.from_model_config(AutoConfig.from_pretrained(  # nosec B615
            model_dir, local_files_only=True))
    eos = generation.eos_token_id
    if eos is not None:
        ids.update(int(i) for i in ([eos] if isinstance(eos, int) else eos))
    return sorted(ids)
