"""Reading a LoRA adapter in PEFT's format: adapter_config.json + adapter_model.safetensors.

PEFT adds `lora_B(lora_A(x)) * scaling` to a targeted projection's output, with lora_A
[r, in], lora_B [out, r] and scaling = alpha / r (alpha / sqrt(r) with `use_rslora`). The
weights file names them `base_model.model.model.layers.{i}.{self_attn|mlp}.{proj}.lora_{A|B}
.weight`; which projections of which layers an adapter changes is read from those names.

Everything an adapter could need that this runner does not do (DoRA, trained biases, extra
trained modules, per-module ranks, embeddings or the head) is refused by name: an adapter is
never served partly.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError
from safetensors.torch import load

from gpu_runner.config import ModelConfig

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# The model's fused projections and their Hugging Face parts, in output order: the
# projections an adapter may change.
PROJECTIONS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}
SUPPORTED_MODULES = tuple(part for parts in PROJECTIONS.values() for part in parts)
_KEY = re.compile(
    r"base_model\.model\.model\.layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight")
# Config entries whose non-default values change the arithmetic in ways not served here.
_REFUSED_SETTINGS = {
    "use_dora": "DoRA", "modules_to_save": "modules_to_save", "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern", "fan_in_fan_out": "fan_in_fan_out",
    "trainable_token_indices": "trainable_token_indices", "lora_bias": "lora_bias",
    "target_parameters": "target_parameters", "alora_invocation_tokens": "aLoRA",
    "layer_replication": "layer_replication",
}


class AdapterError(ValueError):
    """The adapter cannot be served (the message says why)."""


class AdapterNotFoundError(AdapterError):
    """The path holds no adapter."""


@dataclass(frozen=True)
class PeftAdapter:
    """One adapter's weights on the host, in float32, as PEFT defines them."""

    rank: int
    scaling: float
    # (layer, module) -> (lora_A [rank, in], lora_B [out, rank])
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    digest: str  # of the config and weights files

    @property
    def target_modules(self) -> tuple[str, ...]:
        present = {module for _, module in self.weights}
        return tuple(m for m in SUPPORTED_MODULES if m in present)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.weights.values())


def read_peft_adapter(path: Path, model: ModelConfig, max_rank: int) -> PeftAdapter:
    """The adapter at `path`, checked against the model and the rank limit."""
    config_file, weights_file = path / CONFIG_FILE, path / WEIGHTS_FILE
    if not config_file.is_file() or not weights_file.is_file():
        raise AdapterNotFoundError(f"{path} holds no PEFT adapter (needs {CONFIG_FILE} "
                                   f"and {WEIGHTS_FILE})")
    try:
        config_bytes, weights_bytes = config_file.read_bytes(), weights_file.read_bytes()
    except OSError as error:
        raise AdapterError(f"cannot read the adapter at {path}: {error}") from None
    config = _parse_config(config_bytes)
    rank = _positive_int(config.get("r"), "r")
    if rank > max_rank:
        raise AdapterError(f"the adapter's rank {rank} is over --max-lora-rank {max_rank}")
    alpha = config.get("lora_alpha", 8)
    if not isinstance(alpha, (int, float)) or isinstance(alpha, bool) or alpha <= 0:
        raise AdapterError(f"lora_alpha must be a positive number, not {alpha!r}")
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    try:
        tensors = load(weights_bytes)  # the bytes hashed above, not a second read
    except (SafetensorError, ValueError) as error:
        raise AdapterError(f"{WEIGHTS_FILE} is not a readable safetensors file: {error}") \
            from None
    weights = _pair_weights(tensors, model, rank)
    digest = hashlib.sha256(config_bytes + b"\0" + weights_bytes).hexdigest()[:32]
    return PeftAdapter(rank=rank, scaling=float(scaling), weights=weights, digest=digest)


def _parse_config(raw: bytes) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise AdapterError(f"{CONFIG_FILE} is not JSON: {error}") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{CONFIG_FILE} must hold an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"peft_type {config.get('peft_type')!r} is not served (LORA only)")
    for key, what in _REFUSED_SETTINGS.items():
        if config.get(key):
            raise AdapterError(f"{what} adapters are not served ({key} is set)")
    if config.get("bias", "none") != "none":
        raise AdapterError(f"adapters with trained biases are not served "
                           f"(bias={config.get('bias')!r})")
    return config


def _positive_int(value: object, name: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise AdapterError(f"{name} must be a positive integer, not {value!r}")
    return value


def _pair_weights(tensors: dict[str, torch.Tensor], model: ModelConfig, rank: int
                  ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.fullmatch(key)
        if match is None:
            raise AdapterError(f"weight {key!r} is not a LoRA weight of a served projection "
                               f"({', '.join(SUPPORTED_MODULES)})")
        layer, module, half = int(match[1]), match[2], match[3]
        if module not in SUPPORTED_MODULES:
            raise AdapterError(f"target module {module!r} is not served "
                               f"(served: {', '.join(SUPPORTED_MODULES)})")
        if layer >= model.num_layers:
            raise AdapterError(f"weight {key!r} names layer {layer}; the model has "
                               f"{model.num_layers}")
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise AdapterError(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise AdapterError(f"layer {layer} {module} has lora_A or lora_B but not both")
        in_size, out_size = _projection_shape(model, module)
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_size) or tuple(b.shape) != (out_size, rank):
            raise AdapterError(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} / lora_B {tuple(b.shape)} do "
                f"not fit rank {rank} and the model's {in_size} -> {out_size} projection")
        if not (a.is_floating_point() and b.is_floating_point()):
            raise AdapterError(f"layer {layer} {module}: weights must be floating point")
        a, b = a.float(), b.float()
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"layer {layer} {module}: weights hold inf or NaN")
        weights[(layer, module)] = (a, b)
    return weights


def projection_sizes(config: ModelConfig) -> dict[str, tuple[int, tuple[int, ...]]]:
    """Per fused projection: (in_features, output size of each part)."""
    hidden, inter = config.hidden_size, config.intermediate_size
    return {
        "qkv": (hidden, (config.q_size, config.kv_size, config.kv_size)),
        "o": (config.q_size, (hidden,)),
        "gate_up": (hidden, (inter, inter)),
        "down": (inter, (hidden,)),
    }


def _projection_shape(model: ModelConfig, module: str) -> tuple[int, int]:
    """(in_features, out_features) of a Hugging Face projection of this model."""
    for name, (in_size, out_sizes) in projection_sizes(model).items():
        if module in PROJECTIONS[name]:
            return in_size, out_sizes[PROJECTIONS[name].index(module)]
    raise AdapterError(f"target module {module!r} is not served")
