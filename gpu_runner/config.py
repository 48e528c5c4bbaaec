"""The model description the runner needs, read from a Hugging Face config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

_ARCH_BY_MODEL_TYPE = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


class ModelConfigError(ValueError):
    """config.json is missing, unreadable or lacks a field the runner needs."""


@dataclass(frozen=True)
class RopeScaling:
    """Rotary embedding frequencies: theta and the scaling rule ("default" or "llama3")."""

    theta: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Shapes and switches of a Llama-family decoder (Llama, Qwen2, Qwen3)."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeScaling
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim


def load_model_config(folder: Path) -> ModelConfig:
    """Reads folder/config.json (and generation_config.json for extra EOS ids)."""
    path = Path(folder) / "config.json"
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError as error:
        raise ModelConfigError(f"{path} does not exist") from error
    except json.JSONDecodeError as error:
        raise ModelConfigError(f"{path} is not valid JSON: {error}") from error
    try:
        return model_config_from_dict(raw, _generation_eos(Path(folder)))
    except KeyError as error:
        raise ModelConfigError(f"{path} lacks the field {error.args[0]!r}") from error


def model_config_from_dict(raw: dict[str, Any], extra_eos: tuple[int, ...] = ()) -> ModelConfig:
    """Builds a ModelConfig from the fields of a config.json."""
    architecture = _architecture(raw)
    heads = int(raw["num_attention_heads"])
    hidden = int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    return ModelConfig(
        architecture=architecture,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=int(raw["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_rope(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        # Qwen2 always has q/k/v biases; its config does not say so.
        attention_bias=is_qwen2 or bool(raw.get("attention_bias", False)),
        qk_norm=architecture == "Qwen3ForCausalLM",
        eos_token_ids=_merge_ids(_as_ids(raw.get("eos_token_id")), extra_eos),
    )


def _architecture(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if architectures:
        return str(architectures[0])
    model_type = raw.get("model_type", "")
    if model_type in _ARCH_BY_MODEL_TYPE:
        return _ARCH_BY_MODEL_TYPE[model_type]
    raise ModelConfigError(
        f"unknown architecture: no 'architectures' and model_type {model_type!r}"
    )


def _rope(raw: dict[str, Any]) -> RopeScaling:
    # transformers >= 5 writes "rope_parameters"; older configs "rope_theta" + "rope_scaling".
    params = dict(raw.get("rope_parameters") or {})
    scaling = dict(raw.get("rope_scaling") or {})
    merged = {**scaling, **params}
    theta = float(merged.get("rope_theta", raw.get("rope_theta", 10000.0)))
    kind = str(merged.get("rope_type", merged.get("type", "default")))
    if kind not in ("default", "llama3"):
        raise ModelConfigError(f"rope scaling {kind!r} is not supported (default, llama3)")
    return RopeScaling(
        theta=theta,
        kind=kind,
        factor=float(merged.get("factor", 1.0)),
        low_freq_factor=float(merged.get("low_freq_factor", 1.0)),
        high_freq_factor=float(merged.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            merged.get("original_max_position_embeddings", 8192)
        ),
    )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, list):
        return tuple(int(v) for v in value)
    return (int(value),)


def _merge_ids(first: tuple[int, ...], second: tuple[int, ...]) -> tuple[int, ...]:
    return tuple(dict.fromkeys([*first, *second]))


def _generation_eos(folder: Path) -> tuple[int, ...]:
    path = folder / "generation_config.json"
    if not path.is_file():
        return ()
    try:
        return _as_ids(json.loads(path.read_text()).get("eos_token_id"))
    except (json.JSONDecodeError, TypeError, ValueError):
        return ()
