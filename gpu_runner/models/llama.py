"""The Llama family decoder (Llama 2/3, SmolLM2, Qwen2 with q/k/v bias, Qwen3 with q/k norm),
written for paged attention: tokens of many sequences are packed into one [tokens, hidden]
batch and attention reads and writes the paged KV cache."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gpu_runner.attention.metadata import AttentionMetadata
from gpu_runner.attention.selection import AttentionBackend
from gpu_runner.config import ModelConfig
from gpu_runner.layers.activation import silu_and_mul
from gpu_runner.layers.embedding import Embedding, LMHead
from gpu_runner.layers.linear import Linear, MergedLinear
from gpu_runner.layers.rms_norm import RMSNorm
from gpu_runner.layers.rotary import RotaryEmbedding, Rotation, interleaving_order
from gpu_runner.lora.slots import LayerLora, LoraBatch


class Attention(nn.Module):
    """Fused q/k/v projection, optional q/k RMSNorm, rotary, paged attention, output."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.num_heads = config.num_heads
        self.num_kv_heads = config.num_kv_heads
        self.head_dim = config.head_dim
        self.qkv_proj = MergedLinear(
            config.hidden_size, [config.q_size, config.kv_size, config.kv_size],
            bias=config.attention_bias,
        )
        self.o_proj = Linear(config.q_size, config.hidden_size)
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps) if config.qk_norm else None
        self.backend = backend

    def forward(
        self,
        hidden: torch.Tensor,
        rotation: Rotation,
        layer_cache: torch.Tensor,
        plan: Any,  # the backend's plan of this batch
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        tokens = hidden.shape[0]
        qkv = self.qkv_proj(hidden)
        if lora is not None:
            lora.add("qkv", hidden, qkv)
        q, k, v = self.qkv_proj.split(qkv)
        v = v.view(tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None:
            q = rotation.apply(self.q_norm(q.view(tokens, self.num_heads, self.head_dim)))
            k = rotation.apply(self.k_norm(k.view(tokens, self.num_kv_heads, self.head_dim)))
        else:
            # q and k sit side by side in the fused output: rotate both in one pass.
            heads = self.num_heads + self.num_kv_heads
            qk = rotation.apply(qkv[:, : heads * self.head_dim].view(tokens, heads,
                                                                    self.head_dim))
            q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        attended = self.backend.forward(q, k, v, layer_cache, plan)
        out = self.o_proj(attended)
        if lora is not None:
            lora.add("o", attended, out)
        return out

    def reorder_qk_rows(self, order: torch.Tensor) -> None:
        """Applies a per-head order of the head dimensions to the q and k projections (and
        their norms); v and the output projection are untouched."""
        qk_heads = self.num_heads + self.num_kv_heads
        head_starts = torch.arange(qk_heads)[:, None] * self.head_dim
        rows = torch.cat((
            (head_starts + order[None, :]).flatten(),
            torch.arange(qk_heads * self.head_dim, self.qkv_proj.weight.shape[0]),
        )).to(self.qkv_proj.weight.device)
        self.qkv_proj.weight.data = self.qkv_proj.weight.data.index_select(0, rows)
        if self.qkv_proj.bias is not None:
            self.qkv_proj.bias.data = self.qkv_proj.bias.data.index_select(0, rows)
        for norm in (self.q_norm, self.k_norm):
            if norm is not None:
                norm.weight.data = norm.weight.data[order.to(norm.weight.device)]


class MLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up fused."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = MergedLinear(
            config.hidden_size, [config.intermediate_size, config.intermediate_size]
        )
        self.down_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, hidden: torch.Tensor, lora: LayerLora | None = None) -> torch.Tensor:
        if lora is None:
            return self.down_proj(silu_and_mul(self.gate_up_proj(hidden)))
        gate_up = self.gate_up_proj(hidden)
        lora.add("gate_up", hidden, gate_up)
        activated = silu_and_mul(gate_up)
        out = self.down_proj(activated)
        lora.add("down", activated, out)
        return out


class DecoderLayer(nn.Module):
    """Pre-norm attention and MLP, each with a residual connection."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, backend)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(
        self,
        delta: torch.Tensor | None,
        residual: torch.Tensor,
        rotation: Rotation,
        layer_cache: torch.Tensor,
        plan: Any,  # the backend's plan of this batch
        lora: LayerLora | None = None,
    ) -> torch.Tensor:
        """Adds `delta` (the previous layer's output; None in the first layer) to `residual`,
        the running sum of the layer outputs, in place (it is this forward's own buffer), and
        returns this layer's output, to be added by the next layer: each addition is then
        fused with the norm that reads its result."""
        if delta is None:
            normed = self.input_layernorm(residual)
        else:
            normed = self.input_layernorm.add_and_norm(delta, residual)
        attention = self.self_attn(normed, rotation, layer_cache, plan, lora)
        return self.mlp(self.post_attention_layernorm.add_and_norm(attention, residual), lora)


class LlamaForCausalLM(nn.Module):
    """Embedding, decoder layers, final norm, and a head computing only the logits asked for.

    Parameter names follow Hugging Face's except the fused `qkv_proj` and `gate_up_proj`
    (the loader fuses them)."""

    def __init__(self, config: ModelConfig, backend: AttentionBackend) -> None:
        super().__init__()
        self.config = config
        self.backend = backend
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, backend) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = LMHead(config.vocab_size, config.hidden_size)
        self.rotary = RotaryEmbedding(
            config.head_dim, config.max_position_embeddings, config.rope
        )

    def interleave_rotary(self) -> None:
        """Switches to the interleaved rotary layout (see layers/rotary.py): reorders every
        q/k head once, after the weights are loaded. K in the KV cache is then stored in this
        order too (every attention backend is indifferent to it). float32 only."""
        if self.rotary.interleaved:
            return
        order = interleaving_order(self.config.head_dim)
        with torch.no_grad():
            for module in self.modules():
                if isinstance(module, Attention):
                    module.reorder_qk_rows(order)
        self.rotary.interleaved = True

    def forward(
        self,
        token_ids: torch.Tensor,  # [tokens]
        kv_cache: torch.Tensor,  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        meta: AttentionMetadata,
        lora: LoraBatch | None = None,
    ) -> torch.Tensor:
        """Runs every new token through the model (each row through its LoRA adapter, if
        `lora` gives it one); returns logits [sampled seqs, vocab] for the tokens at
        meta.logits_indices only."""
        plan = self.backend.plan(meta)
        rotation = self.rotary.rotation(meta.positions, self.embed_tokens.weight.dtype)
        residual = self.embed_tokens(token_ids)
        delta = None
        for index, layer in enumerate(self.layers):
            layer_lora = None if lora is None else LayerLora(lora, index)
            delta = layer(delta, residual, rotation, kv_cache[index], plan, layer_lora)
        rows = meta.logits_indices  # only these rows need the last addition and the norm
        last = self.norm.add_and_norm(delta[rows], residual[rows]) if delta is not None \
            else self.norm(residual[rows])
        return self.lm_head(last).float()
