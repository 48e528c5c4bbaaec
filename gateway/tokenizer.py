"""The model's tokenizer: text and chat messages to token ids, ids back to text."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

log = logging.getLogger(__name__)

# The roles a chat message may have, as gRPC clients send them (the HTTP API maps OpenAI's role
# names onto these: gateway/http/protocol.py OPENAI_ROLES).
CHAT_ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class ChatMessage:
    """One chat message (role is one of CHAT_ROLES)."""

    role: str
    content: str


class Tokenizer:
    """A Hugging Face tokenizer with the model's chat template."""

    def __init__(self, folder: Path) -> None:
        self._tok: Any = AutoTokenizer.from_pretrained(str(folder))
        self.folder = folder
        # len() counts added tokens, which vocab_size may leave out.
        self.size = len(self._tok)
        # The Rust tokenizer decodes as transformers' decode does, less its per-call Python
        # work, where transformers adds nothing after it (its clean-up of spaces, which it
        # skips for BPE tokenizers unless forced).
        self._backend: Any = getattr(self._tok, "_tokenizer", None)
        bpe = type(getattr(self._backend, "model", None)).__name__ == "BPE"
        forced = getattr(self._tok, "clean_up_tokenization_spaces_for_bpe_even_though_it_will_"
                                    "corrupt_output", False)
        if getattr(self._tok, "clean_up_tokenization_spaces", False) and (not bpe or forced):
            self._backend = None

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    def encode(self, text: str) -> list[int]:
        """Plain text as the tokenizer's own rules tokenize it (special tokens included)."""
        return list(self._tok.encode(text))

    @property
    def has_chat_template(self) -> bool:
        return self._tok.chat_template is not None

    def render_chat(self, messages: Sequence[ChatMessage]) -> str:
        """The conversation rendered with the chat template, generation prompt added."""
        if not self.has_chat_template:
            raise ValueError("the model has no chat template: send a plain prompt instead")
        conversation = [{"role": m.role, "content": m.content} for m in messages]
        text = self._tok.apply_chat_template(
            conversation, tokenize=False, add_generation_prompt=True
        )
        return str(text)

    def encode_chat(self, messages: Sequence[ChatMessage]) -> list[int]:
        """Chat messages as token ids (the template already holds the special tokens)."""
        return list(self._tok.encode(self.render_chat(messages), add_special_tokens=False))

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        if self._backend is not None:
            return str(self._backend.decode(list(token_ids),
                                            skip_special_tokens=skip_special_tokens))
        return str(self._tok.decode(list(token_ids), skip_special_tokens=skip_special_tokens))

    def decode_batch(self, sequences: list[list[int]]) -> list[str]:
        """decode() of each sequence (special tokens skipped), in one call where it can."""
        if self._backend is not None:
            return list(self._backend.decode_batch(sequences, skip_special_tokens=True))
        return [self.decode(sequence) for sequence in sequences]

    def token_pieces(self, token_ids: Sequence[int]) -> list[str]:
        """Each token's piece as the tokenizer names it (e.g. 'Ġhello')."""
        return [str(piece) for piece in self._tok.convert_ids_to_tokens(list(token_ids))]


def load_tokenizer(spec: str | None) -> Tokenizer:
    """The tokenizer of the model named by `spec` (see common.model_store.resolve_model)."""
    from common.model_store import resolve_model

    folder = resolve_model(spec)
    log.info("tokenizer from %s", folder)
    return Tokenizer(folder)
