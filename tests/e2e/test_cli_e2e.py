"""`pagewire serve --demo` (what `make run` starts) and the CLI clients, as a user runs them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from gateway.launcher import is_serving
from tests.e2e.conftest import kv_bytes_for_blocks
from tests.helpers.services import ROOT, free_port

BANNER = "pagewire is serving on"


def pagewire(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.cli", *args]


def test_serve_demo_answers_then_generate_and_chat_stream_then_ctrl_c_stops_all(
        tmp_path: Path) -> None:
    port = free_port()
    http_port = free_port()
    output_path = tmp_path / "serve.out"
    with open(output_path, "wb") as output:
        serve = subprocess.Popen(
            pagewire("serve", "--demo", "--port", str(port), "--http-port", str(http_port),
                     "--log-dir", str(tmp_path),
                     "--kv-cache-memory", str(kv_bytes_for_blocks(64)),
                     "--max-model-len", "512"),
            cwd=ROOT, stdout=output, stderr=subprocess.STDOUT, env={**os.environ},
        )
    try:
        deadline = time.monotonic() + 300
        while BANNER not in output_path.read_text(errors="replace"):
            assert serve.poll() is None, output_path.read_text(errors="replace")
            assert time.monotonic() < deadline, output_path.read_text(errors="replace")
            time.sleep(0.2)
        shown = output_path.read_text()
        # The demo asked for the capital of France: SmolLM2 knows it.
        assert "Paris" in shown.split(BANNER)[0]
        assert f"127.0.0.1:{port}" in shown

        address = f"127.0.0.1:{port}"
        generated = subprocess.run(
            pagewire("generate", "--address", address, "--temperature", "0",
                     "--max-tokens", "8", "--usage", "The capital of France is"),
            cwd=ROOT, capture_output=True, text=True, timeout=120, check=True)
        assert "Paris" in generated.stdout
        assert "completion 8" in generated.stderr
        chatted = subprocess.run(
            pagewire("chat", "--address", address, "--temperature", "0", "--max-tokens", "24"),
            cwd=ROOT, input="What is the capital of France?\n", capture_output=True,
            text=True, timeout=120, check=True)
        assert "Paris" in chatted.stdout

        # The banner says how to call the HTTP API, and it answers as the gRPC one does.
        assert f"http://127.0.0.1:{http_port}/v1" in shown
        answer = httpx.post(f"http://127.0.0.1:{http_port}/v1/completions", timeout=120,
                            json={"prompt": "The capital of France is", "max_tokens": 8,
                                  "temperature": 0}).json()
        assert "Paris" in answer["choices"][0]["text"]
        assert answer["usage"]["completion_tokens"] == 8

        serve.send_signal(signal.SIGINT)
        assert serve.wait(60) == 0
        assert not is_serving(address)  # the gateway went down with the launcher
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"http://127.0.0.1:{http_port}/health")
        log_names = sorted(p.name for p in tmp_path.glob("*.log"))
        assert log_names == ["block_service.log", "gateway.log", "gpu_runner.log"]
    finally:
        if serve.poll() is None:
            serve.kill()
            serve.wait()
