"""gateway/adapters.py without servers: names, the effective cache salt, the Execute's
adapters column, and a runner loop's view of its runner (RunnerAdapters) on a stub."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import grpc
import pytest

from block_service.core import MAX_CACHE_SALT_BYTES
from gateway.adapters import (
    Adapter,
    AdapterAdmin,
    AdapterCatalog,
    AdapterError,
    ModelNames,
    RunnerAdapters,
    UnknownModel,
    effective_salt,
)
from gateway.request import Request
from gateway.scheduler import Work
from gateway.sequence import SamplingConfig, Sequence
from gateway.step_builder import SamplingRow, build_execute_request
from protos import runner_pb2

SQL = Adapter("sql", "/adapters/sql", 8, "a" * 64)
CHAT = Adapter("chat", "/adapters/chat", 4, "b" * 64)


def test_effective_salt_folds_in_the_digest_and_keeps_base_requests_as_they_were() -> None:
    assert effective_salt("", None) == ""
    assert effective_salt("tenant", None) == "tenant"
    assert effective_salt("", SQL) != effective_salt("", CHAT)
    assert effective_salt("", SQL) == "lora:" + SQL.digest
    # A name reloaded with other files: another digest, another salt.
    assert effective_salt("", SQL) != effective_salt("", Adapter("sql", SQL.path, 8, "c" * 64))
    with_tenant = effective_salt("tenant", SQL)
    assert with_tenant.startswith("lora:" + SQL.digest + ":")
    assert with_tenant not in (effective_salt("", SQL), effective_salt("other", SQL))
    longest = effective_salt("x" * MAX_CACHE_SALT_BYTES, SQL)
    assert len(longest.encode()) <= MAX_CACHE_SALT_BYTES


def test_two_adapters_with_one_prompt_never_share_a_first_block() -> None:
    def seq_of(adapter: Adapter | None) -> Sequence:
        request = Request("r", list(range(20, 30)), SamplingConfig(max_tokens=4), 100,
                          frozenset(), lambda ids: "", cache_salt=effective_salt("", adapter),
                          adapter=adapter.name if adapter else "")
        return request.sequences[0]
    keys = {seq_of(adapter).first_block(4) for adapter in (None, SQL, CHAT)}
    assert len(keys) == 3
    assert seq_of(SQL).adapter == "sql" and seq_of(None).adapter == ""


def test_model_names_resolve_base_aliases_and_adapters() -> None:
    catalog = AdapterCatalog()
    catalog.put(SQL)
    names = ModelNames("base", frozenset({"folder"}), catalog)
    assert names.resolve("") is None and names.resolve("base") is None
    assert names.resolve("folder") is None
    assert names.resolve("sql") == SQL
    with pytest.raises(UnknownModel, match=r"'nope' does not exist.*'base', 'sql'"):
        names.resolve("nope")
    catalog.remove("sql")
    with pytest.raises(UnknownModel):
        names.resolve("sql")


def test_execute_adapters_column_in_sequence_order_and_empty_for_base_only() -> None:
    def work(request_id: str, adapter: str) -> Work:
        seq = Sequence(request_id, 0, [5, 6, 7], 3, seed=1, adapter=adapter)
        seq.block_table = [0]
        return Work(seq, 0, 3, [0, 1, 2], True)
    row = SamplingRow(0.0, 1.0, 0, 0.0, None)
    rows = {name: row for name in ("a", "b", "c")}
    mixed = [work("a", ""), work("b", "sql"), work("c", "chat")]
    call = build_execute_request(mixed, [], 1, "client", 1, rows)
    assert list(call.message().adapters) == ["", "sql", "chat"]
    base_only = [work("a", ""), work("b", "")]
    assert list(build_execute_request(base_only, [], 1, "client", 1, rows).message()
                .adapters) == []


# ----- RunnerAdapters and AdapterAdmin on a stub runner ----------------------------------

class _Refused(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


@dataclass
class StubRunner:
    """LoadAdapter / UnloadAdapter: digest = 'd' + path; paths in `refuse` are NOT_FOUND."""

    refuse: set[str] = field(default_factory=set)
    calls: list[tuple[str, str]] = field(default_factory=list)

    def LoadAdapter(self, request: runner_pb2.LoadAdapterRequest, timeout: float
                    ) -> runner_pb2.LoadAdapterResponse:
        self.calls.append(("load", request.name))
        if request.path in self.refuse:
            raise _Refused(grpc.StatusCode.NOT_FOUND, f"no adapter in {request.path}")
        return runner_pb2.LoadAdapterResponse(adapter=runner_pb2.AdapterInfo(
            name=request.name, path=request.path, rank=4, digest="d" + request.path))

    def UnloadAdapter(self, request: runner_pb2.UnloadAdapterRequest, timeout: float
                      ) -> runner_pb2.UnloadAdapterResponse:
        self.calls.append(("unload", request.name))
        return runner_pb2.UnloadAdapterResponse()


@dataclass
class StubLoop:
    address: str
    adapters: RunnerAdapters
    max_loras: int = 2

    def unload_adapter(self, name: str) -> None:
        self.adapters.retire(name)


def make_loops(catalog: AdapterCatalog, *runners: StubRunner) -> list[StubLoop]:
    return [StubLoop(f"r{i}", RunnerAdapters(catalog, cast(Any, stub), f"runner r{i}", 1.0))
            for i, stub in enumerate(runners)]


def test_a_failed_load_is_undone_on_the_runners_that_took_it() -> None:
    catalog = AdapterCatalog()
    good, bad = StubRunner(), StubRunner(refuse={"/x"})
    loops = make_loops(catalog, good, bad)
    admin = AdapterAdmin(ModelNames("base", catalog=catalog), lambda: loops)
    with pytest.raises(AdapterError) as error:
        admin.load("x", "/x")
    assert error.value.code_name == "NOT_FOUND" and "runner r1" in error.value.message
    assert good.calls == [("load", "x"), ("unload", "x")]
    assert catalog.get("x") is None and not loops[0].adapters.is_loaded("x")


def test_names_the_admin_refuses() -> None:
    catalog = AdapterCatalog()
    loops = make_loops(catalog, StubRunner())
    admin = AdapterAdmin(ModelNames("base", frozenset({"alias"}), catalog), lambda: loops)
    for name, code in (("", "INVALID_ARGUMENT"), ("a b", "INVALID_ARGUMENT"),
                       ("é", "INVALID_ARGUMENT"), ("x" * 129, "INVALID_ARGUMENT"),
                       ("base", "FAILED_PRECONDITION"), ("alias", "FAILED_PRECONDITION")):
        with pytest.raises(AdapterError) as error:
            admin.load(name, "/p")
        assert error.value.code_name == code, name
    assert admin.load("org/model:v1.2_x-y", "/p").name == "org/model:v1.2_x-y"
    loops[0].max_loras = 0
    with pytest.raises(AdapterError, match="--max-loras"):
        admin.load("other", "/p")


def test_sync_loads_the_catalog_after_a_reset_and_unloads_drained_adapters() -> None:
    catalog = AdapterCatalog()
    runner = StubRunner()
    (loop,) = make_loops(catalog, runner)
    admin = AdapterAdmin(ModelNames("base", catalog=catalog), lambda: [loop])
    admin.load("sql", "/sql")
    loop.adapters.sync(set)
    assert runner.calls == [("load", "sql")]  # loaded by the admin: nothing more to do
    loop.adapters.reset()  # the runner restarted
    loop.adapters.sync(set)
    assert runner.calls[-1] == ("load", "sql") and loop.adapters.is_loaded("sql")
    admin.unload("sql")
    loop.adapters.sync(lambda: {"sql"})  # a sequence still runs on it
    assert runner.calls[-1] == ("load", "sql") and loop.adapters.is_loaded("sql")
    loop.adapters.sync(set)
    assert runner.calls[-1] == ("unload", "sql") and not loop.adapters.is_loaded("sql")


def test_a_runner_that_refuses_a_catalog_adapter_is_marked() -> None:
    catalog = AdapterCatalog()
    catalog.put(Adapter("sql", "/sql", 4, "d/sql"))
    (loop,) = make_loops(catalog, StubRunner(refuse={"/sql"}))
    loop.adapters.sync(set)
    assert "NOT_FOUND" in loop.adapters.failure("sql")
    assert not loop.adapters.is_loaded("sql")
