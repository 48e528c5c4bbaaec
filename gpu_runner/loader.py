"""Loads a Hugging Face folder of safetensors into our model, fusing q/k/v and gate/up.

Errors name the file and the tensor: a missing tensor, a shape that does not match the
config, an unknown architecture.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from gpu_runner.attention.torch_backend import TorchAttentionBackend
from gpu_runner.config import ModelConfig, load_model_config
from gpu_runner.models.llama import LlamaForCausalLM
from gpu_runner.models.registry import model_class


class WeightLoadError(ValueError):
    """A weight file is missing, lacks a tensor, or holds one of the wrong shape."""


@dataclass(frozen=True)
class LoadedModel:
    """The model ready to run and the description it was built from."""

    model: LlamaForCausalLM
    config: ModelConfig
    folder: Path


class _TensorIndex:
    """Where each tensor of a (possibly sharded) safetensors checkpoint lives."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.file_of: dict[str, Path] = {}
        for file in self._files():
            with safe_open(str(file), framework="pt") as handle:
                for name in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                    self.file_of[name] = file

    def _files(self) -> list[Path]:
        index = self.folder / "model.safetensors.index.json"
        if index.is_file():
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            files = [self.folder / shard for shard in shards]
        else:
            files = sorted(self.folder.glob("*.safetensors"))
        if not files:
            raise WeightLoadError(f"{self.folder}: no *.safetensors file")
        for file in files:
            if not file.is_file():
                raise WeightLoadError(f"{file}: listed in the index but missing")
        return files

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def get(self, name: str, shape: tuple[int, ...]) -> torch.Tensor:
        file = self.file_of.get(name)
        if file is None:
            raise WeightLoadError(f"{self.folder}: tensor {name!r} is missing")
        with safe_open(str(file), framework="pt") as handle:
            tensor = handle.get_tensor(name)
        if tuple(tensor.shape) != shape:
            raise WeightLoadError(
                f"{file}: tensor {name!r} has shape {tuple(tensor.shape)}, expected {shape}"
            )
        return tensor


def load_model(
    folder: Path, device: torch.device, dtype: torch.dtype
) -> LoadedModel:
    """Builds the model named by folder/config.json and fills it from its safetensors."""
    folder = Path(folder)
    config = load_model_config(folder)
    cls = model_class(config.architecture)
    backend = TorchAttentionBackend(config.num_heads, config.num_kv_heads, config.head_dim)
    tensors = dict(_fused_tensors(_TensorIndex(folder), config))
    with torch.device(device):
        # Parameters start as torch.empty: cheap, and every one is overwritten below.
        model = cls(config, backend)
    _assign(model, tensors, dtype)
    model.eval()
    return LoadedModel(model=model, config=config, folder=folder)


def _assign(model: LlamaForCausalLM, tensors: dict[str, torch.Tensor], dtype: torch.dtype) -> None:
    params = dict(model.named_parameters(remove_duplicate=False))
    missing = sorted(set(params) - set(tensors))
    if missing:
        raise WeightLoadError(f"no weight produced for {missing[:5]}")
    for name, param in params.items():
        param.data = tensors[name].to(device=param.device, dtype=dtype)
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def _fused_tensors(
    index: _TensorIndex, config: ModelConfig
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (our parameter name, tensor), concatenating the projections we fuse."""
    hidden, inter, head = config.hidden_size, config.intermediate_size, config.head_dim
    yield "embed_tokens.weight", index.get("model.embed_tokens.weight",
                                           (config.vocab_size, hidden))
    yield "norm.weight", index.get("model.norm.weight", (hidden,))
    if config.tie_word_embeddings and "lm_head.weight" not in index:
        yield "lm_head.weight", index.get("model.embed_tokens.weight",
                                          (config.vocab_size, hidden))
    else:
        yield "lm_head.weight", index.get("lm_head.weight", (config.vocab_size, hidden))
    for layer in range(config.num_layers):
        hf = f"model.layers.{layer}."
        ours = f"layers.{layer}."
        qkv_shapes = {"q_proj": config.q_size, "k_proj": config.kv_size, "v_proj": config.kv_size}
        yield ours + "self_attn.qkv_proj.weight", torch.cat([
            index.get(f"{hf}self_attn.{name}.weight", (rows, hidden))
            for name, rows in qkv_shapes.items()
        ])
        if config.attention_bias:
            yield ours + "self_attn.qkv_proj.bias", torch.cat([
                index.get(f"{hf}self_attn.{name}.bias", (rows,))
                for name, rows in qkv_shapes.items()
            ])
        yield ours + "self_attn.o_proj.weight", index.get(
            f"{hf}self_attn.o_proj.weight", (hidden, config.q_size))
        if config.qk_norm:
            yield ours + "self_attn.q_norm.weight", index.get(f"{hf}self_attn.q_norm.weight",
                                                              (head,))
            yield ours + "self_attn.k_norm.weight", index.get(f"{hf}self_attn.k_norm.weight",
                                                              (head,))
        yield ours + "mlp.gate_up_proj.weight", torch.cat([
            index.get(f"{hf}mlp.gate_proj.weight", (inter, hidden)),
            index.get(f"{hf}mlp.up_proj.weight", (inter, hidden)),
        ])
        yield ours + "mlp.down_proj.weight", index.get(f"{hf}mlp.down_proj.weight",
                                                       (hidden, inter))
        yield ours + "input_layernorm.weight", index.get(f"{hf}input_layernorm.weight",
                                                         (hidden,))
        yield ours + "post_attention_layernorm.weight", index.get(
            f"{hf}post_attention_layernorm.weight", (hidden,))
