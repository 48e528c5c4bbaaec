"""The model store: GGUF conversion held against transformers' own GGUF loader, and errors."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from common import model_store
from common.model_store import ModelStoreError, default_gguf_path, resolve_model

ROOT = Path(__file__).resolve().parents[2]


def test_converted_gguf_equals_transformers_gguf_loader(default_model_dir: Path) -> None:
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    gguf = default_gguf_path()
    reference = AutoModelForCausalLM.from_pretrained(
        gguf.parent, gguf_file=gguf.name, dtype=torch.float32
    ).state_dict()
    # The conversion code as it is now (not only what an earlier run left in the cache).
    fresh = model_store.gguf_tensors(gguf)
    cached = load_file(default_model_dir / "model.safetensors")
    # Tied embeddings: transformers lists lm_head.weight too, as the embedding itself.
    assert set(fresh) == set(cached) == set(reference) - {"lm_head.weight"}
    for name, array in fresh.items():
        assert torch.equal(torch.from_numpy(array.copy()), reference[name]), name
        assert torch.equal(cached[name], reference[name]), name


def test_default_folder_is_complete(default_model_dir: Path) -> None:
    for name in ("config.json", "model.safetensors", "tokenizer.json", "generation_config.json"):
        assert (default_model_dir / name).is_file(), name
    assert resolve_model("default") == default_model_dir  # converted once, then reused


def test_default_model_is_named_and_samples_as_its_authors_recommend(
        default_model_dir: Path) -> None:
    import json

    from transformers import GenerationConfig

    assert model_store.model_name(default_model_dir) == "SmolLM2-135M-Instruct"
    # transformers reads the folder's generation config as the model card's sampling.
    generation = GenerationConfig.from_pretrained(default_model_dir)
    assert generation.do_sample is True
    assert (generation.temperature, generation.top_p) == (0.2, 0.9)
    written = json.loads((default_model_dir / "generation_config.json").read_text())
    assert written["eos_token_id"] == 2  # the GGUF's own fields are kept


@pytest.mark.parametrize(("file_name", "name"), [
    ("SmolLM2-135M-Instruct.Q4_1.gguf", "SmolLM2-135M-Instruct"),
    ("Qwen3-0.6B-Q4_K_M.gguf", "Qwen3-0.6B"),
    ("llama-3.2-1b-instruct.f16.gguf", "llama-3.2-1b-instruct"),
    ("tiny-IQ2_XS.gguf", "tiny"),
    ("model.gguf", "model"),
    ("Q8_0.gguf", "Q8_0"),  # nothing left but the suffix: the name stays whole
])
def test_gguf_model_name_drops_the_quantization(file_name: str, name: str) -> None:
    assert model_store.gguf_model_name(Path(file_name)) == name


def test_model_name_of_a_plain_or_broken_folder_is_its_name(tmp_path: Path) -> None:
    folder = tmp_path / "my-model"
    folder.mkdir()
    assert model_store.model_name(folder) == "my-model"
    (folder / model_store.NAME_FILE).write_text("not json")
    assert model_store.model_name(folder) == "my-model"
    (folder / model_store.NAME_FILE).write_text('{"name": "Friendly"}')
    assert model_store.model_name(folder) == "Friendly"


def test_folder_resolves_to_itself(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path


def test_folder_without_config_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ModelStoreError, match=r"config\.json"):
        resolve_model(str(tmp_path))


def test_missing_gguf_names_the_file(tmp_path: Path) -> None:
    missing = tmp_path / "absent.gguf"
    with pytest.raises(ModelStoreError, match=r"absent\.gguf"):
        resolve_model(str(missing))


def test_unknown_gguf_architecture_names_the_file(tmp_path: Path,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from gguf import GGUFWriter

    path = tmp_path / "other.gguf"
    writer = GGUFWriter(str(path), "gpt2")
    writer.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    monkeypatch.setenv("PAGEWIRE_CACHE_DIR", str(tmp_path / "cache"))
    with pytest.raises(ModelStoreError, match=r"other\.gguf.*'gpt2'"):
        resolve_model(str(path))
    # Nothing half-written is left in the cache.
    assert list((tmp_path / "cache").iterdir()) == []


def test_losing_the_publish_race_keeps_the_winner(tmp_path: Path) -> None:
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text('{"winner": true}')
    staging = tmp_path / ".model-tmp"
    staging.mkdir()
    (staging / "config.json").write_text('{"winner": false}')
    model_store._publish(staging, target)
    assert "true" in (target / "config.json").read_text()


def test_gguf_names_map_to_hugging_face_names() -> None:
    assert model_store.hf_tensor_name("blk.3.attn_q.weight") == \
        "model.layers.3.self_attn.q_proj.weight"
    assert model_store.hf_tensor_name("blk.0.attn_k_norm.weight") == \
        "model.layers.0.self_attn.k_norm.weight"
    assert model_store.hf_tensor_name("output.weight") == "lm_head.weight"
    assert model_store.hf_tensor_name("blk.0.unknown.weight") is None


def test_module_does_not_import_torch() -> None:
    code = "import sys, common.model_store; sys.exit('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], cwd=ROOT).returncode == 0
