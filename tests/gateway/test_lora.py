"""Multi-LoRA serving through a real gateway on the fake runner (tests/gateway/fake_runner.py:
a row run through an adapter gets a token of its own, so every output shows which adapter
ran it): model selection over gRPC and HTTP, the Execute's adapters column, KV isolation by
cache salt, loads and unloads over the AdminService and the HTTP API, a runner restart, an
unload while a request runs, and the max_loras cap."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import httpx
import pytest

from gateway.tokenizer import Tokenizer
from protos import gateway_pb2, gateway_pb2_grpc
from tests.gateway.fake_runner import expected_tokens, folder_digest, make_adapter
from tests.gateway.stack import Stack
from tests.helpers.services import ServiceProcess, free_port

BASE = "fake"  # the fake runner's model name: the served name


@pytest.fixture(scope="module")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("adapters")
    make_adapter(folder / "sql", rank=8, weights=b"sql weights")
    make_adapter(folder / "chat", rank=4, weights=b"chat weights")
    make_adapter(folder / "extra", rank=4, weights=b"extra weights")
    make_adapter(folder / "too-big", rank=64)
    (folder / "empty").mkdir()
    return folder


@pytest.fixture(scope="module")
def stack(tokenizer: Tokenizer, block_service: ServiceProcess,
          adapters: Path) -> Iterator[Stack]:
    s = Stack(tokenizer, block_service, num_blocks=256, epoch=51, max_loras=2,
              http_port=free_port(), lora_modules=[("sql", str(adapters / "sql"))])
    yield s
    s.close()


@pytest.fixture(scope="module")
def http(stack: Stack) -> Iterator[httpx.Client]:
    with stack.http_client() as client:
        yield client


def admin_stub(stack: Stack) -> gateway_pb2_grpc.AdminServiceStub:
    return gateway_pb2_grpc.AdminServiceStub(stack.client.channel)


def prompt_of(i: int, length: int = 9) -> list[int]:
    """A prompt no other test sends."""
    return [3000 + 61 * i + 5 * j for j in range(length)]


def refusal(call: Callable[[], object]) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as error:
        call()
    return error.value


def wait_for(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


# ----- model selection ---------------------------------------------------------------------

def test_lora_modules_are_served_from_the_start(stack: Stack, adapters: Path) -> None:
    info = stack.client.model_info()
    assert [(a.name, a.path, a.rank) for a in info.adapters] == [
        ("sql", str(adapters / "sql"), 8)]


def test_grpc_model_runs_the_adapter_or_the_base(stack: Stack, adapters: Path) -> None:
    digest = folder_digest(adapters / "sql")
    prompt = prompt_of(1)
    on_adapter = stack.client.complete(token_ids=prompt, max_tokens=6, temperature=0,
                                       model="sql")
    assert on_adapter.token_ids[0] == expected_tokens(prompt, 6, digest=digest)
    for base_name in ("", BASE):
        on_base = stack.client.complete(token_ids=prompt, max_tokens=6, temperature=0,
                                        model=base_name)
        assert on_base.token_ids[0] == expected_tokens(prompt, 6)


def test_an_unknown_model_is_not_found_over_grpc(stack: Stack) -> None:
    error = refusal(lambda: stack.client.complete(token_ids=[5, 6, 7], max_tokens=2,
                                                  model="no-such-adapter"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    assert "'no-such-adapter' does not exist" in error.details()
    assert "'sql'" in error.details()


def test_http_model_runs_the_adapter_and_is_echoed(stack: Stack, http: httpx.Client) -> None:
    prompt = prompt_of(2)
    grpc_text = stack.client.complete(token_ids=prompt, max_tokens=5, temperature=0,
                                      model="sql").texts[0]
    for path, body in (("/v1/completions", {"prompt": prompt}),
                       ("/v1/chat/completions", {"messages": [{"role": "user",
                                                               "content": "hi"}]})):
        reply = http.post(path, json={**body, "model": "sql", "max_tokens": 5,
                                      "temperature": 0})
        assert reply.status_code == 200, reply.text
        assert reply.json()["model"] == "sql"
    completion = http.post("/v1/completions", json={"prompt": prompt, "model": "sql",
                                                    "max_tokens": 5, "temperature": 0}).json()
    assert completion["choices"][0]["text"] == grpc_text
    base = http.post("/v1/completions", json={"prompt": prompt, "model": BASE,
                                              "max_tokens": 5, "temperature": 0}).json()
    assert base["model"] == BASE and base["choices"][0]["text"] != grpc_text


def test_an_unknown_model_is_404_over_http(http: httpx.Client) -> None:
    reply = http.post("/v1/completions", json={"prompt": "hi", "model": "nope",
                                               "max_tokens": 2})
    assert reply.status_code == 404
    error = reply.json()["error"]
    assert (error["code"], error["param"]) == ("model_not_found", "model")


def test_v1_models_lists_the_adapters_with_their_parent(stack: Stack, http: httpx.Client,
                                                        adapters: Path) -> None:
    data = http.get("/v1/models").json()["data"]
    assert data[0]["id"] == BASE
    sql = next(entry for entry in data if entry["id"] == "sql")
    assert (sql["object"], sql["owned_by"], sql["root"], sql["parent"]) == (
        "model", "pagewire", str(adapters / "sql"), BASE)


# ----- the Execute's adapters column and KV isolation ------------------------------------

def test_execute_names_each_sequences_adapter(stack: Stack, adapters: Path) -> None:
    admin = admin_stub(stack)
    admin.LoadLoraAdapter(gateway_pb2.LoadLoraAdapterRequest(
        lora_name="chat", lora_path=str(adapters / "chat")))
    try:
        digests = {"": "", "sql": folder_digest(adapters / "sql"),
                   "chat": folder_digest(adapters / "chat")}
        jobs = [(prompt_of(10 + i), model) for i, model in enumerate(["", "sql", "chat", ""])]
        first = len(stack.runner.adapter_columns)
        stack.runner.proceed.clear()  # so that the four meet in one batch
        results: dict[int, list[int]] = {}

        def run(i: int, prompt: list[int], model: str) -> None:
            results[i] = stack.client.complete(token_ids=prompt, max_tokens=4,
                                               temperature=0, model=model).token_ids[0]
        threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
        for thread in threads:
            thread.start()
        time.sleep(0.3)
        stack.runner.proceed.set()
        for thread in threads:
            thread.join(30)
        for i, (prompt, model) in enumerate(jobs):
            assert results[i] == expected_tokens(prompt, 4, digest=digests[model])
        columns = stack.runner.adapter_columns[first:]
        assert any({"", "sql", "chat"} <= set(column) for column in columns)
    finally:
        stack.runner.proceed.set()
        admin.UnloadLoraAdapter(gateway_pb2.UnloadLoraAdapterRequest(lora_name="chat"))


def test_a_base_only_step_leaves_the_adapters_column_empty(stack: Stack) -> None:
    first = len(stack.runner.adapter_columns)
    stack.client.complete(token_ids=prompt_of(20), max_tokens=3, temperature=0)
    assert stack.runner.adapter_columns[first:] and all(
        column == [] for column in stack.runner.adapter_columns[first:])


def test_adapters_never_share_cached_kv_with_the_base_or_each_other(
        stack: Stack, adapters: Path) -> None:
    admin = admin_stub(stack)
    admin.LoadLoraAdapter(gateway_pb2.LoadLoraAdapterRequest(
        lora_name="chat", lora_path=str(adapters / "chat")))
    try:
        prompt = prompt_of(30, 13)

        def cached(model: str, salt: str = "") -> int:
            result = stack.client.complete(token_ids=prompt, max_tokens=2, temperature=0,
                                           model=model, cache_salt=salt)
            assert result.usage is not None
            return result.usage.cached_tokens
        assert cached("") == 0
        assert cached("sql") == 0  # not the base model's KV
        assert cached("sql") == 12  # its own
        assert cached("chat") == 0  # not another adapter's
        assert cached("sql", salt="tenant") == 0  # the client's salt still counts
        assert cached("sql", salt="tenant") == 12
        assert cached("") == 12  # the base model's own, unchanged
    finally:
        admin.UnloadLoraAdapter(gateway_pb2.UnloadLoraAdapterRequest(lora_name="chat"))


# ----- loads and unloads ------------------------------------------------------------------

def test_load_and_unload_over_http(stack: Stack, http: httpx.Client, adapters: Path) -> None:
    reply = http.post("/v1/load_lora_adapter", json={"lora_name": "extra",
                                                     "lora_path": str(adapters / "extra")})
    assert reply.status_code == 200 and "extra" in reply.text
    assert "extra" in [m["id"] for m in http.get("/v1/models").json()["data"]]
    assert "extra" in stack.runner.adapters
    prompt = prompt_of(40)
    ran = http.post("/v1/completions", json={"prompt": prompt, "model": "extra",
                                             "max_tokens": 3, "temperature": 0})
    assert ran.status_code == 200 and ran.json()["model"] == "extra"
    reply = http.post("/v1/unload_lora_adapter", json={"lora_name": "extra"})
    assert reply.status_code == 200 and "extra" in reply.text
    assert "extra" not in [m["id"] for m in http.get("/v1/models").json()["data"]]
    gone = http.post("/v1/completions", json={"prompt": prompt, "model": "extra",
                                              "max_tokens": 3})
    assert gone.status_code == 404
    wait_for(lambda: "extra" not in stack.runner.adapters)


@pytest.mark.parametrize(("path", "body", "status", "param"), [
    ("/v1/load_lora_adapter", {"lora_path": "x"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x"}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "bad name!", "lora_path": "x"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": BASE, "lora_path": "x"}, 400, "lora_name"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": 3}, 400, "lora_path"),
    ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "x", "other": 1}, 400, "other"),
    ("/v1/unload_lora_adapter", {}, 400, "lora_name"),
    ("/v1/unload_lora_adapter", {"lora_name": "never-loaded"}, 404, "lora_name"),
])
def test_http_adapter_refusals_name_their_field(http: httpx.Client, path: str,
                                                body: dict[str, object], status: int,
                                                param: str) -> None:
    reply = http.post(path, json=body)
    assert reply.status_code == status, reply.text
    assert reply.json()["error"]["param"] == param


def test_http_load_of_a_folder_without_an_adapter(http: httpx.Client, adapters: Path) -> None:
    reply = http.post("/v1/load_lora_adapter", json={"lora_name": "empty",
                                                     "lora_path": str(adapters / "empty")})
    assert reply.status_code == 404
    reply = http.post("/v1/load_lora_adapter", json={"lora_name": "big",
                                                     "lora_path": str(adapters / "too-big")})
    assert reply.status_code == 400 and "rank 64" in reply.json()["error"]["message"]


def test_grpc_admin_load_unload_and_refusals(stack: Stack, adapters: Path) -> None:
    admin = admin_stub(stack)
    loaded = admin.LoadLoraAdapter(gateway_pb2.LoadLoraAdapterRequest(
        lora_name="extra", lora_path=str(adapters / "extra")))
    assert (loaded.adapter.name, loaded.adapter.rank) == ("extra", 4)
    again = admin.LoadLoraAdapter(gateway_pb2.LoadLoraAdapterRequest(  # same files: no-op
        lora_name="extra", lora_path=str(adapters / "extra")))
    assert again.adapter.name == "extra"
    other_files = refusal(lambda: admin.LoadLoraAdapter(gateway_pb2.LoadLoraAdapterRequest(
        lora_name="extra", lora_path=str(adapters / "chat"))))
    assert other_files.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "extra" in [a.name for a in stack.client.model_info().adapters]
    admin.UnloadLoraAdapter(gateway_pb2.UnloadLoraAdapterRequest(lora_name="extra"))
    assert "extra" not in [a.name for a in stack.client.model_info().adapters]
    cases = [
        (gateway_pb2.LoadLoraAdapterRequest(lora_name="a b", lora_path="x"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (gateway_pb2.LoadLoraAdapterRequest(lora_name="x" * 129, lora_path="x"),
         grpc.StatusCode.INVALID_ARGUMENT),
        (gateway_pb2.LoadLoraAdapterRequest(lora_path=str(adapters / "chat")),
         grpc.StatusCode.INVALID_ARGUMENT),
        (gateway_pb2.LoadLoraAdapterRequest(lora_name=BASE, lora_path=str(adapters / "chat")),
         grpc.StatusCode.FAILED_PRECONDITION),
        (gateway_pb2.LoadLoraAdapterRequest(lora_name="e", lora_path=str(adapters / "empty")),
         grpc.StatusCode.NOT_FOUND),
    ]
    for request, code in cases:
        assert refusal(lambda r=request: admin.LoadLoraAdapter(r)).code() == code
    assert refusal(lambda: admin.UnloadLoraAdapter(gateway_pb2.UnloadLoraAdapterRequest(
        lora_name="never-loaded"))).code() == grpc.StatusCode.NOT_FOUND
    assert "e" not in stack.runner.adapters  # a failed load leaves nothing loaded


# ----- runner restarts, unloads while running, the max_loras cap --------------------------

def test_a_restarted_runner_gets_the_catalog_again(tokenizer: Tokenizer,
                                                   block_service: ServiceProcess,
                                                   adapters: Path) -> None:
    s = Stack(tokenizer, block_service, num_blocks=64, epoch=61, max_loras=2,
              lora_modules=[("sql", str(adapters / "sql"))])
    try:
        digest = folder_digest(adapters / "sql")
        prompt = prompt_of(50)
        stream = s.client.generate(token_ids=prompt, max_tokens=30, temperature=0,
                                   model="sql")
        first = next(stream)
        s.runner.restart(epoch=62)  # new epoch: no KV, no adapters
        tokens = list(first.outputs[0].token_ids)
        tokens += [t for message in stream for o in message.outputs for t in o.token_ids]
        assert tokens == expected_tokens(prompt, 30, digest=digest)
        assert "sql" in s.runner.adapters
        again = s.client.complete(token_ids=prompt_of(51), max_tokens=3, temperature=0,
                                  model="sql")
        assert again.token_ids[0] == expected_tokens(prompt_of(51), 3, digest=digest)
    finally:
        s.close()


def test_unload_waits_for_the_running_requests(tokenizer: Tokenizer,
                                               block_service: ServiceProcess,
                                               adapters: Path) -> None:
    s = Stack(tokenizer, block_service, num_blocks=64, epoch=63, max_loras=2,
              lora_modules=[("sql", str(adapters / "sql"))])
    try:
        digest = folder_digest(adapters / "sql")
        prompt = prompt_of(60)
        stream = s.client.generate(token_ids=prompt, max_tokens=20, temperature=0,
                                   model="sql")
        first = next(stream)
        s.runner.proceed.clear()  # the request is mid-way
        admin_stub(s).UnloadLoraAdapter(gateway_pb2.UnloadLoraAdapterRequest(lora_name="sql"))
        error = refusal(lambda: s.client.complete(token_ids=prompt, max_tokens=2,
                                                  model="sql"))
        assert error.code() == grpc.StatusCode.NOT_FOUND  # at once, for new requests
        assert "sql" in s.runner.adapters  # still running on it
        s.runner.proceed.set()
        tokens = list(first.outputs[0].token_ids)
        tokens += [t for message in stream for o in message.outputs for t in o.token_ids]
        assert tokens == expected_tokens(prompt, 20, digest=digest)  # finished, nothing lost
        wait_for(lambda: "sql" not in s.runner.adapters)
        assert ("unload", "sql") in s.runner.adapter_calls
    finally:
        s.runner.proceed.set()
        s.close()


def test_more_adapters_than_max_loras_run_one_after_another(
        tokenizer: Tokenizer, block_service: ServiceProcess, adapters: Path) -> None:
    s = Stack(tokenizer, block_service, num_blocks=64, epoch=65, max_loras=1,
              lora_modules=[("sql", str(adapters / "sql")), ("chat", str(adapters / "chat"))])
    try:
        digests = {"sql": folder_digest(adapters / "sql"),
                   "chat": folder_digest(adapters / "chat")}
        jobs = [(prompt_of(70 + i), model) for i, model in enumerate(["sql", "chat", "sql"])]
        results: dict[int, list[int]] = {}

        def run(i: int, prompt: list[int], model: str) -> None:
            results[i] = s.client.complete(token_ids=prompt, max_tokens=8, temperature=0,
                                           model=model).token_ids[0]
        threads = [threading.Thread(target=run, args=(i, *job)) for i, job in enumerate(jobs)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
        # The fake runner refuses a batch naming two adapters: every row ran, one at a time.
        for i, (prompt, model) in enumerate(jobs):
            assert results[i] == expected_tokens(prompt, 8, digest=digests[model])
        assert all(len({name for name in column if name}) <= 1
                   for column in s.runner.adapter_columns)
    finally:
        s.close()


def test_a_runner_without_max_loras_refuses_loads(tokenizer: Tokenizer,
                                                  block_service: ServiceProcess,
                                                  adapters: Path) -> None:
    s = Stack(tokenizer, block_service, num_blocks=64, epoch=67)
    try:
        error = refusal(lambda: admin_stub(s).LoadLoraAdapter(
            gateway_pb2.LoadLoraAdapterRequest(lora_name="sql",
                                               lora_path=str(adapters / "sql"))))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "--max-loras" in error.details()
    finally:
        s.close()


def test_a_runner_back_without_the_adapter_ends_only_its_requests(
        tokenizer: Tokenizer, block_service: ServiceProcess, adapters: Path) -> None:
    s = Stack(tokenizer, block_service, num_blocks=64, epoch=69, max_loras=2,
              lora_modules=[("sql", str(adapters / "sql"))])
    try:
        on_adapter = s.client.generate(token_ids=prompt_of(80), max_tokens=40, temperature=0,
                                       model="sql")
        on_base = s.client.generate(token_ids=prompt_of(81), max_tokens=40, temperature=0)
        next(on_adapter), next(on_base)
        with s.runner.lock:  # back with --max-loras 0: it refuses the adapter
            s.runner.max_loras = 0
        s.runner.restart(epoch=70)
        error = refusal(lambda: list(on_adapter))
        assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "could not be loaded" in error.details()
        assert list(on_base)  # the base request runs on
        assert refusal(lambda: s.client.complete(token_ids=[5, 6, 7], max_tokens=2,
                                                 model="sql")).code() == \
            grpc.StatusCode.FAILED_PRECONDITION
    finally:
        s.close()
