"""`pagewire serve --demo` (what `make run` starts) and the commands its banner suggests, run as
a user pastes them: each answers in the model's chat sentences, token for token what
transformers' greedy generate gives for the same chat (the server runs greedy through
--override-generation-config, which this test covers too)."""

from __future__ import annotations

import json
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import grpc
import httpx
import pytest
from google.protobuf import json_format
from transformers import AutoTokenizer

from common.model_store import resolve_model
from gateway.client import PagewireClient
from gateway.launcher import is_serving
from protos import gateway_pb2, gateway_pb2_grpc
from tests.e2e import oracle
from tests.e2e.conftest import kv_bytes_for_blocks
from tests.helpers.services import ROOT, SERVE_BANNER, free_port, start_serve

BANNER = SERVE_BANNER
# The banner's answers end (EOS) well within this; the oracle must see their end to compare.
ORACLE_TOKENS = 200
# A sentence: words, then a full stop, question or exclamation mark.
SENTENCE = re.compile(r"[A-Z][^.!?]*\b[a-z]+\b[^.!?]*[.!?]")


def pagewire(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", *args]


def chat_answer(tokenizer: Any, conversation: list[tuple[str, str]]) -> str:
    """transformers' greedy answer to a chat, its prompt rendered by transformers' own chat
    template (not pagewire's tokenizer), decoded as pagewire streams it (special tokens
    out)."""
    text = tokenizer.apply_chat_template([{"role": role, "content": content}
                                          for role, content in conversation],
                                         tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(text, add_special_tokens=False)
    tokens = oracle.greedy(prompt_ids, ORACLE_TOKENS)
    assert tokens[-1] == tokenizer.eos_token_id, "the oracle did not reach the answer's end"
    return str(tokenizer.decode(tokens, skip_special_tokens=True))


def assert_sentences(text: str) -> None:
    assert SENTENCE.search(text), f"not a sentence: {text!r}"


def banner_commands(shown: str) -> dict[str, list[str]]:
    """The banner's suggested commands by program (pagewire generate / chat, grpcurl, curl)."""
    commands: dict[str, list[str]] = {}
    for line in shown.split(BANNER, 1)[1].splitlines():
        text = line.strip().removeprefix("try:").strip()
        if text.startswith(("pagewire ", "grpcurl ", "curl ")):
            words = shlex.split(text)
            key = " ".join(words[:2]) if words[0] == "pagewire" else words[0]
            commands[key] = words
    return commands


def test_banner_commands_answer_in_chat_sentences_then_ctrl_c_stops_all(tmp_path: Path) -> None:
    port = free_port()
    http_port = free_port()
    output_path = tmp_path / "serve.out"
    serve = start_serve(["--demo", "--port", str(port), "--http-port", str(http_port),
                         "--log-dir", str(tmp_path),
                         "--kv-cache-memory", str(kv_bytes_for_blocks(64)),
                         "--max-model-len", "512",
                         "--override-generation-config", '{"temperature": 0}'], output_path)
    try:
        time.sleep(0.5)  # the rest of the banner
        shown = output_path.read_text()
        # The demo asked for the capital of France: SmolLM2 knows it.
        assert "Paris" in shown.split(BANNER)[0]
        assert f"{BANNER} SmolLM2-135M-Instruct on 127.0.0.1:{port}" in shown
        address = f"127.0.0.1:{port}"
        tokenizer = AutoTokenizer.from_pretrained(resolve_model(None))
        commands = banner_commands(shown)
        assert set(commands) == {"pagewire generate", "pagewire chat", "grpcurl", "curl"}

        # The model card's sampling, with the operator's temperature over it.
        with PagewireClient(address) as client:
            info = client.model_info()
        assert info.model == "SmolLM2-135M-Instruct" and info.has_chat_template
        defaults = info.default_sampling_params
        assert [f.name for f, _ in defaults.ListFields()] == ["temperature", "top_p"]
        assert defaults.temperature == 0 and defaults.top_p == pytest.approx(0.9)

        # pagewire generate: the prompt as a chat message (the model has a template).
        words = commands["pagewire generate"]
        generated = subprocess.run(pagewire(*words[1:]), cwd=ROOT, capture_output=True,
                                   text=True, timeout=120, check=True)
        expected = chat_answer(tokenizer, [("user", words[-1])])
        assert generated.stdout.strip() == expected.strip()
        assert_sentences(generated.stdout)
        # --raw completes the text as is: not what the chat gives.
        raw = subprocess.run(pagewire(*words[1:-1], "--raw", "--max-tokens", "16", words[-1]),
                             cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
        raw_ids = oracle.greedy(tokenizer.encode(words[-1]), 16)
        assert raw.stdout.strip() == tokenizer.decode(raw_ids, skip_special_tokens=True).strip()

        # pagewire chat: a conversation that remembers its first turn.
        first, second = "What is the capital of France?", "And what is it famous for?"
        chatted = subprocess.run(pagewire(*commands["pagewire chat"][1:]), cwd=ROOT,
                                 input=f"{first}\n{second}\n", capture_output=True, text=True,
                                 timeout=180, check=True)
        answer_1 = chat_answer(tokenizer, [("user", first)])
        answer_2 = chat_answer(tokenizer, [("user", first), ("assistant", answer_1),
                                           ("user", second)])
        assert chatted.stdout == f"{answer_1}\n{answer_2}\n"
        assert "Paris" in answer_1
        assert_sentences(answer_2)

        # grpcurl's request, sent as grpcurl would (its JSON through the proto's JSON mapping).
        words = commands["grpcurl"]
        body = words[words.index("-d") + 1]
        request = json_format.Parse(body, gateway_pb2.GenerateRequest())
        assert words[-2:] == [address, "pagewire.gateway.v1.GenerationService/Generate"]
        with grpc.insecure_channel(address) as channel:
            stream = gateway_pb2_grpc.GenerationServiceStub(channel).Generate(request)
            text = "".join(o.text for m in stream for o in m.outputs)
        question = json.loads(body)["messages"]["messages"][0]["content"]
        assert text == chat_answer(tokenizer, [("user", question)])
        assert_sentences(text)

        # curl, run as printed where curl is installed (httpx with its body elsewhere).
        words = commands["curl"]
        body = words[words.index("-d") + 1]
        if shutil.which("curl"):
            printed = subprocess.run(words, capture_output=True, text=True, timeout=120,
                                     check=True).stdout
            answer = json.loads(printed)
        else:
            answer = httpx.post(words[1], json=json.loads(body), timeout=120).json()
        question = json.loads(body)["messages"][0]["content"]
        content = answer["choices"][0]["message"]["content"]
        assert content == chat_answer(tokenizer, [("user", question)])
        assert answer["model"] == "SmolLM2-135M-Instruct"
        assert_sentences(content)

        # The HTTP API shows the same defaults and answers under the old folder name too.
        base = f"http://127.0.0.1:{http_port}"
        listed = httpx.get(f"{base}/v1/models", timeout=30).json()["data"][0]
        assert listed["id"] == "SmolLM2-135M-Instruct"
        assert listed["default_sampling_params"] == {"temperature": 0.0, "top_p": 0.9}
        old_name = resolve_model(None).name
        plain = httpx.post(f"{base}/v1/completions", timeout=120, json={
            "model": old_name, "prompt": "The capital of France is", "max_tokens": 8}).json()
        assert "Paris" in plain["choices"][0]["text"]
        assert plain["usage"]["completion_tokens"] == 8

        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
        assert not is_serving(address)  # the gateway went down with the launcher
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health")
        log_names = sorted(p.name for p in tmp_path.glob("*.log"))
        assert log_names == ["block_service.log", "gateway.log", "gpu_runner.log"]
        gateway_log = (tmp_path / "gateway.log").read_text()
        assert "serving the model as 'SmolLM2-135M-Instruct'; default sampling: " \
               "temperature=0, top_p=0.9" in gateway_log
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
