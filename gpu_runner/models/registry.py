"""Architecture name (config.json "architectures") -> model class."""

from __future__ import annotations

from gpu_runner.models.llama import LlamaForCausalLM

# Every supported architecture is a variant of the Llama decoder (flags in ModelConfig).
MODEL_CLASSES: dict[str, type[LlamaForCausalLM]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
}


class UnknownArchitectureError(ValueError):
    """The model's architecture has no implementation here."""


def model_class(architecture: str) -> type[LlamaForCausalLM]:
    """The class implementing `architecture`, or a clear error listing the supported ones."""
    try:
        return MODEL_CLASSES[architecture]
    except KeyError:
        supported = ", ".join(sorted(MODEL_CLASSES))
        raise UnknownArchitectureError(
            f"architecture {architecture!r} is not supported (supported: {supported})"
        ) from None
