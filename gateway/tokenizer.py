"""The model's tokenizer: text and chat messages to token ids, ids back to text."""

from __future__ import annotations

import copy
import json
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from jinja2 import TemplateError
from transformers import AutoTokenizer

from gateway.tools import FunctionTool, call_text, response_text, tools_system_text

log = logging.getLogger(__name__)

# The roles a chat message may have, as gRPC clients send them (the HTTP API maps OpenAI's role
# names onto these: gateway/http/protocol.py OPENAI_ROLES). "tool": a tool's result.
CHAT_ROLES = ("system", "user", "assistant", "tool")
# A chat template that reads this variable renders tools, calls and results itself.
_TOOLS_VARIABLE = re.compile(r"\btools\b")


@dataclass(frozen=True)
class ToolCall:
    """A call an assistant message made: `arguments` is JSON text."""

    name: str
    arguments: str
    id: str = ""


@dataclass(frozen=True)
class ChatMessage:
    """One chat message (role is one of CHAT_ROLES): an assistant's may have tool calls, a
    tool's answers the call `tool_call_id`."""

    role: str
    content: str
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""


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

    def render_chat(self, messages: Sequence[ChatMessage],
                    tools: Sequence[FunctionTool] = ()) -> str:
        """The conversation rendered with the chat template, generation prompt added.

        A template that takes `tools` gets them and the messages in OpenAI's shape; for any
        other, the tools, calls and results are written in as Hermes-trained models read them
        (a system message describing the tools, `<tool_call>` and `<tool_response>` blocks).
        """
        if not self.has_chat_template:
            raise ValueError("the model has no chat template: send a plain prompt instead")
        try:
            if self._template_takes_tools(bool(tools)):
                conversation = [_openai_message(m) for m in messages]
                text = self._tok.apply_chat_template(
                    conversation, tools=[t.openai() for t in tools] or None, tokenize=False,
                    add_generation_prompt=True)
            else:
                text = self._tok.apply_chat_template(
                    _hermes_messages(messages, tools), tokenize=False,
                    add_generation_prompt=True)
        except TemplateError as error:  # the template's own checks (e.g. roles in turn)
            raise ValueError(f"messages: the model's chat template refused them: {error}"
                             ) from None
        return str(text)

    def encode_chat(self, messages: Sequence[ChatMessage],
                    tools: Sequence[FunctionTool] = ()) -> list[int]:
        """Chat messages as token ids (the template already holds the special tokens)."""
        return list(self._tok.encode(self.render_chat(messages, tools),
                                     add_special_tokens=False))

    def _template_takes_tools(self, with_tools: bool) -> bool:
        """Whether the template transformers picks renders tools itself (a model may have a
        template of its own for requests with tools)."""
        template = self._tok.chat_template
        if isinstance(template, dict):
            template = template.get("tool_use" if with_tools and "tool_use" in template
                                    else "default", "")
        return bool(_TOOLS_VARIABLE.search(str(template)))

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

    def backend_json(self) -> str:
        """The Rust tokenizer as tokenizer.json text, added tokens included, without padding
        or truncation (what structured output's token matcher is built from)."""
        backend = copy.copy(self._tok.backend_tokenizer)
        backend.no_padding()
        backend.no_truncation()
        return str(backend.to_str())


def _openai_message(message: ChatMessage) -> dict[str, Any]:
    """A message as chat templates with tool support take it (OpenAI's shape, with the
    calls' arguments as objects, which templates write out with `tojson`)."""
    entry: dict[str, Any] = {"role": message.role, "content": message.content}
    if message.tool_calls:
        entry["tool_calls"] = [
            {"id": call.id, "type": "function",
             "function": {"name": call.name, "arguments": _json_or_text(call.arguments)}}
            for call in message.tool_calls]
    if message.role == "tool":
        entry["tool_call_id"] = message.tool_call_id
    return entry


def _json_or_text(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _hermes_messages(messages: Sequence[ChatMessage], tools: Sequence[FunctionTool]
                     ) -> list[dict[str, str]]:
    """Messages for a template that knows nothing of tools: the tools described in the
    system message (before its own text, or in a new first one), each assistant's calls as
    `<tool_call>` blocks after its text, and tool results as a user message of
    `<tool_response>` blocks (one message for results in a row: templates may insist that
    users and assistants take turns)."""
    result: list[dict[str, str]] = []
    after_result = False
    for message in messages:
        if message.role == "tool":
            answer = response_text(message.content)
            if after_result:
                result[-1]["content"] += "\n" + answer
            else:
                result.append({"role": "user", "content": answer})
            after_result = True
            continue
        after_result = False
        text = message.content
        if message.tool_calls:
            blocks = [call_text(call.name, call.arguments) for call in message.tool_calls]
            text = "\n".join([text, *blocks] if text else blocks)
        result.append({"role": message.role, "content": text})
    if tools:
        description = tools_system_text(tools)
        if result and result[0]["role"] == "system":
            result[0]["content"] = description + "\n\n" + result[0]["content"]
        else:
            result.insert(0, {"role": "system", "content": description})
    return result


def load_tokenizer(spec: str | None) -> Tokenizer:
    """The tokenizer of the model named by `spec` (see common.model_store.resolve_model)."""
    from common.model_store import resolve_model

    folder = resolve_model(spec)
    log.info("tokenizer from %s", folder)
    return Tokenizer(folder)
