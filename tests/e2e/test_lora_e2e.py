"""LoRA adapters end to end on the default model: `pagewire serve --lora-modules` (three
services as processes) against transformers + PEFT as the oracle.

One server: 3 adapters for 2 slots (--max-loras 2, so the scheduler holds requests of a third
adapter back and the runner evicts), a KV pool too small for every request at once (so
sequences are preempted and recomputed). Greedy outputs over gRPC equal PEFT's generate for
every adapter and the base model; the same prompt under two adapters shares no cached KV;
the openai client calls an adapter by name; an adapter loaded and unloaded over HTTP while
base and adapter requests run loses no request and gives no 5xx."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import httpx
import openai
import pytest

from common.model_store import resolve_model
from gateway.client import PagewireClient
from gateway.tokenizer import Tokenizer
from tests.e2e import oracle
from tests.e2e.conftest import kv_bytes_for_blocks
from tests.e2e.prompts import PROMPTS
from tests.helpers.lora_adapters import ATTENTION, MLP, greedy, make_peft_adapter, peft_model
from tests.helpers.services import free_port, scrape_metric, start_serve

MAX_TOKENS = 24
NUM_BLOCKS = 8  # 128 tokens (one max_model_len): 8 requests of ~9 + 24 tokens do not fit
ADAPTERS = {  # name -> (rank, targets)
    "sql": (8, ATTENTION + MLP),
    "chat": (4, ("q_proj", "v_proj")),
    "poet": (8, ("k_proj", "o_proj", "up_proj", "down_proj")),
}


@dataclass
class Server:
    address: str
    http: str
    metrics_port: int
    adapters: dict[str, Path]
    spare: Path  # an adapter to load while serving


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    root = tmp_path_factory.mktemp("lora_e2e")
    base = resolve_model(None)
    adapters = {name: make_peft_adapter(base, root / name, rank, targets, seed=i)
                for i, (name, (rank, targets)) in enumerate(ADAPTERS.items())}
    spare = make_peft_adapter(base, root / "spare", 4, ATTENTION, seed=9)
    port, http_port, metrics_port = free_port(), free_port(), free_port()
    serve = start_serve(
        ["--port", str(port), "--http-port", str(http_port), "--metrics-port", str(metrics_port),
         "--log-dir", str(root), "--kv-cache-memory", str(kv_bytes_for_blocks(NUM_BLOCKS)),
         "--max-model-len", "128", "--max-loras", "2", "--max-lora-rank", "8",
         "--lora-modules", *(f"{name}={path}" for name, path in adapters.items())],
        root / "serve.out",
        # The runner's GEMM tuning is not what this tests (~14 s of its start).
        env={"PAGEWIRE_RUNNER_LINEAR_BACKEND": "plain"})
    try:
        yield Server(f"127.0.0.1:{port}", f"http://127.0.0.1:{http_port}", metrics_port,
                     adapters, spare)
    finally:
        serve.terminate()
        serve.wait(60)


@cache
def _oracle(adapter: Path | None, merged: bool = False) -> object:
    return peft_model(resolve_model(None), adapter, merged) if adapter else None


def expected(adapter: Path | None, prompt: list[int], merged: bool = False) -> list[int]:
    if adapter is None:
        return oracle.greedy(prompt, MAX_TOKENS)
    return greedy(_oracle(adapter, merged), prompt, MAX_TOKENS)


def test_mixed_adapters_across_preemption_equal_peft(server: Server) -> None:
    tokenizer = Tokenizer(resolve_model(None))
    prompts = [tokenizer.encode(text) for text in PROMPTS[:8]]
    models = ["sql", "chat", "", "poet", "sql", "poet", "chat", ""]
    with PagewireClient(server.address) as client, ThreadPoolExecutor(len(prompts)) as pool:
        results = list(pool.map(
            lambda p, m: client.complete(token_ids=p, model=m, max_tokens=MAX_TOKENS,
                                         temperature=0, ignore_eos=True, timeout=300),
            prompts, models))
    assert scrape_metric(server.metrics_port, "pagewire_gateway_preemptions_total") > 0
    differs = 0
    for prompt, model, result in zip(prompts, models, results, strict=True):
        adapter = server.adapters[model] if model else None
        assert result.token_ids[0] == expected(adapter, prompt), (model, prompt)
        differs += model != "" and result.token_ids[0] != expected(None, prompt)
    assert differs >= 4  # the adapters change the output, or equality proves little
    # PEFT's merged model agrees (the second oracle).
    assert results[0].token_ids[0] == expected(server.adapters["sql"], prompts[0], merged=True)
    assert scrape_metric(server.metrics_port, "pagewire_gateway_adapter_requests_total",
                         adapter="sql") >= 2


def test_same_prompt_under_two_adapters_shares_no_cached_tokens(server: Server) -> None:
    """And a prefix hit changes no token: every answer, cached or not, equals PEFT's."""
    client = openai.OpenAI(base_url=f"{server.http}/v1", api_key="none", max_retries=0)
    prompt = " ".join(PROMPTS)[:300]  # several full blocks
    tokenizer = Tokenizer(resolve_model(None))
    prompt_ids = tokenizer.encode(prompt)
    base = client.models.list().data[0].id

    def cached(model: str) -> int:
        reply = client.completions.create(model=model, prompt=prompt, max_tokens=8,
                                          temperature=0, extra_body={"ignore_eos": True})
        adapter = server.adapters.get(model)
        want = expected(adapter, prompt_ids)[:8]
        assert reply.choices[0].text == tokenizer.decode(want), model
        details = reply.usage.prompt_tokens_details if reply.usage else None
        return details.cached_tokens or 0 if details else 0

    assert cached("sql") == 0
    assert cached("sql") >= 32  # its own prefix is cached...
    assert cached("chat") == 0  # ...but not for another adapter
    assert cached(base) == 0  # nor for the base model
    assert cached("chat") >= 32
    client.close()


def test_openai_client_loads_calls_and_unloads_an_adapter_under_load(server: Server) -> None:
    client = openai.OpenAI(base_url=f"{server.http}/v1", api_key="none", max_retries=0,
                           timeout=300)
    listed = {m.id: m for m in client.models.list().data}
    base = next(name for name, m in listed.items() if name not in ADAPTERS)
    for name in ADAPTERS:
        assert listed[name].model_extra and listed[name].model_extra["parent"] == base
    tokenizer = Tokenizer(resolve_model(None))
    prompt = tokenizer.encode(PROMPTS[9])

    failures: list[str] = []
    done = threading.Event()

    def keep_busy(model: str) -> int:
        count = 0
        while not done.is_set():
            try:
                client.completions.create(model=model, prompt=PROMPTS[count % 4], max_tokens=4,
                                          temperature=0)
            except openai.APIError as error:
                failures.append(f"{model}: {error}")
            count += 1
        return count

    with ThreadPoolExecutor(2) as pool:
        busy = [pool.submit(keep_busy, base), pool.submit(keep_busy, "chat")]
        with httpx.Client(base_url=server.http, timeout=120) as http:
            loaded = http.post("/v1/load_lora_adapter",
                               json={"lora_name": "spare", "lora_path": str(server.spare)})
            assert loaded.status_code == 200, loaded.text
            reply = client.completions.create(model="spare", prompt=prompt, max_tokens=MAX_TOKENS,
                                              temperature=0, extra_body={"ignore_eos": True})
            assert reply.model == "spare"
            expected_text = tokenizer.decode(expected(server.spare, prompt))
            assert reply.choices[0].text == expected_text
            # Unloaded while one of its requests streams: that request ends whole.
            stream = client.completions.create(model="spare", prompt=prompt, stream=True,
                                               max_tokens=MAX_TOKENS, temperature=0,
                                               extra_body={"ignore_eos": True})
            first = next(iter(stream))
            unloaded = http.post("/v1/unload_lora_adapter", json={"lora_name": "spare"})
            assert unloaded.status_code == 200, unloaded.text
            text = first.choices[0].text + "".join(c.choices[0].text for c in stream)
            assert text == expected_text
            with pytest.raises(openai.NotFoundError):
                client.completions.create(model="spare", prompt=prompt, max_tokens=1)
            again = http.post("/v1/unload_lora_adapter", json={"lora_name": "spare"})
            assert again.status_code == 404
        done.set()
        counts = [future.result() for future in busy]
    assert not failures and min(counts) > 0
    assert "spare" not in {m.id for m in client.models.list().data}
    client.close()
