"""Token embedding and the language-model head (logits only for the rows asked for)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F

from gpu_runner.layers.linear import Linear


class Embedding(nn.Module):
    """Token id -> vector."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class LMHead(Linear):
    """Hidden state -> logits over the vocabulary (a Linear without bias, so it shares the
    packed-weight dispatch). With tied embeddings the weight is the embedding's own tensor
    (the loader shares it); a packed copy is separate."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(hidden_size, vocab_size)
