"""Random LoRA adapters made with PEFT in the test (nothing is downloaded), and PEFT's own
model as the oracle for them."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP = ("gate_proj", "up_proj", "down_proj")


def make_peft_adapter(base: Path, path: Path, rank: int, targets: Sequence[str], seed: int,
                      alpha: float = 16, rslora: bool = False, std: float = 0.05) -> Path:
    """Writes a PEFT LoRA adapter of `base` with random A and B (PEFT's default B is zero:
    an adapter that changes nothing would prove nothing) at `path`."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    config = peft.LoraConfig(r=rank, lora_alpha=alpha, target_modules=list(targets),
                             use_rslora=rslora, init_lora_weights=False)
    wrapped = peft.get_peft_model(model, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if "lora_" in name:
                param.copy_(std * torch.randn(param.shape, generator=generator))
    wrapped.save_pretrained(path)
    return path


def peft_model(base: Path, adapter: Path, merged: bool = False, dtype: Any = None) -> Any:
    """transformers' model with the adapter through PEFT (merged into the weights, or not), in
    `dtype` (default float32)."""
    import peft
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=dtype or torch.float32)
    wrapped = peft.PeftModel.from_pretrained(model, adapter).eval()
    return wrapped.merge_and_unload().eval() if merged else wrapped


def greedy(model: Any, prompt: Sequence[int], steps: int) -> list[int]:
    """`steps` greedy tokens after `prompt` (EOS does not stop it)."""
    import torch

    with torch.inference_mode():
        out = model.generate(torch.tensor([list(prompt)]), max_new_tokens=steps,
                             min_new_tokens=0, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    return out[0, len(prompt):].tolist()
