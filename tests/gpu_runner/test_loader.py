"""Loading Hugging Face folders: sharded checkpoints, rope scaling, and clear errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gpu_runner.config import ModelConfigError, load_model_config
from gpu_runner.loader import WeightLoadError, load_model
from gpu_runner.models.registry import UnknownArchitectureError
from tests.gpu_runner.conftest import make_runner, runner_driver
from tests.helpers.tiny_models import make_tiny_model

CPU = torch.device("cpu")


def _copy(folder: Path, target: Path) -> Path:
    shutil.copytree(folder, target)
    return target


def _edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.update(changes)
    path.write_text(json.dumps(config))


def _hf_logits(folder: Path, prompt: list[int]) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.inference_mode():
        return model(torch.tensor([prompt])).logits[0, -1]


def _our_logits(folder: Path, prompt: list[int]) -> torch.Tensor:
    runner = make_runner(folder, cache_bytes=4 << 20, max_model_len=512)
    driver = runner_driver(runner)
    batch, _ = driver.build([driver.add(prompt)])
    return runner.forward_logits(batch)[0]


def test_sharded_checkpoint_loads_like_the_single_file(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM

    single = make_tiny_model("qwen2", tmp_path / "single")
    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(single).save_pretrained(sharded, max_shard_size="2MB")
    assert (sharded / "model.safetensors.index.json").is_file()
    a = load_model(single, CPU, torch.float32).model.state_dict()
    b = load_model(sharded, CPU, torch.float32).model.state_dict()
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_llama3_rope_scaling_matches_transformers(tmp_path: Path) -> None:
    folder = make_tiny_model("llama", tmp_path / "llama3")
    _edit_config(folder, rope_parameters={
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
    })
    assert load_model_config(folder).rope.kind == "llama3"
    prompt = list(range(100, 400))  # well past original_max_position_embeddings
    torch.testing.assert_close(_our_logits(folder, prompt), _hf_logits(folder, prompt),
                               rtol=0, atol=1e-4)


def test_missing_tensor_names_file_and_tensor(tmp_path: Path) -> None:
    folder = make_tiny_model("qwen3", tmp_path / "broken")
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.layers.1.self_attn.k_norm.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.layers\.1\.self_attn\.k_norm\.weight"):
        load_model(folder, CPU, torch.float32)


def test_shape_mismatch_names_file_and_tensor(tmp_path: Path) -> None:
    folder = make_tiny_model("llama", tmp_path / "mismatch")
    weights = folder / "model.safetensors"
    tensors = load_file(weights)
    name = "model.layers.0.mlp.up_proj.weight"
    tensors[name] = tensors[name][:-1].contiguous()
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(WeightLoadError, match=r"model\.safetensors.*up_proj.*shape"):
        load_model(folder, CPU, torch.float32)


def test_unknown_architecture_is_refused(tmp_path: Path) -> None:
    folder = make_tiny_model("llama", tmp_path / "other")
    _edit_config(folder, architectures=["GPT2LMHeadModel"])
    with pytest.raises(UnknownArchitectureError, match="GPT2LMHeadModel"):
        load_model(folder, CPU, torch.float32)


def test_missing_config_names_the_file(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match=r"config\.json"):
        load_model_config(tmp_path)
