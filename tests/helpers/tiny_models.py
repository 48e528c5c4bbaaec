"""Small random Hugging Face model folders built in the test (nothing is downloaded).

make_tiny_model("qwen3", path) writes config.json, model.safetensors, generation_config.json
and the default model's tokenizer files (so a gateway can tokenize: vocab 49152).
"""

from __future__ import annotations

import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                   "special_tokens_map.json")
VOCAB_SIZE = 49152
BOS_ID, EOS_ID = 1, 2

_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 2048,
    "rms_norm_eps": 1e-6,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    # Wide weights give decisive logits: greedy parity must not hinge on near ties.
    "initializer_range": 0.2,
}
_ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM",
              {"num_hidden_layers": 2, "tie_word_embeddings": True, "rope_theta": 10000.0}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM",
              {"num_hidden_layers": 3, "tie_word_embeddings": False, "rope_theta": 1000000.0}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM",
              {"num_hidden_layers": 4, "tie_word_embeddings": True, "head_dim": 32,
               "rope_theta": 1000000.0}),
}
TINY_ARCHS = tuple(_ARCHS)


def make_tiny_model(arch: str, path: Path, seed: int = 0) -> Path:
    """Writes a random `arch` ("llama", "qwen2", "qwen3") model folder at `path`."""
    import torch
    import transformers

    from common.model_store import resolve_model

    if arch not in _ARCHS:
        raise ValueError(f"unknown tiny arch {arch!r}; choose from {TINY_ARCHS}")
    config_name, model_name, extra = _ARCHS[arch]
    config = getattr(transformers, config_name)(**_COMMON, **extra)
    torch.manual_seed(seed)
    model = getattr(transformers, model_name)(config).eval()
    _spread_norm_weights(model, seed)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(path)
    _copy_tokenizer(resolve_model(None), path)
    return path


def _spread_norm_weights(model: object, seed: int) -> None:
    # RMSNorm weights start at exactly 1; random ones make the parity tests check that the
    # right norm weight is used in the right place.
    import torch

    generator = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, param in model.named_parameters():  # type: ignore[attr-defined]
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.3 * torch.randn(param.shape, generator=generator))


def _copy_tokenizer(source: Path, target: Path) -> None:
    for name in TOKENIZER_FILES:
        if (source / name).is_file():
            shutil.copy(source / name, target / name)
