"""Token embedding and the language-model head (logits only for the rows asked for)."""

from __future__ import annotations

import torch
from torch import nn
from torch.nn import functional as F


class Embedding(nn.Module):
    """Token id -> vector."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class LMHead(nn.Module):
    """Hidden state -> logits over the vocabulary. With tied embeddings the weight is the
    embedding's own tensor (the loader shares it)."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(vocab_size, hidden_size), requires_grad=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.weight)
