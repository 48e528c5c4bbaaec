"""LoRA adapters: the catalog a gateway serves, and keeping every runner in step with it.

- `AdapterCatalog`: name -> Adapter (path, rank and digest as the runners reported them). It
  is what the gateway serves: a name is accepted exactly while it is in the catalog.
- `ModelNames`: what a request's `model` may say (the base model's name or alias, empty, or a
  catalog adapter), for both APIs (gateway/admission.py resolves through it).
- `AdapterAdmin`: loads (LoadAdapter on every runner loop's runner, all or none) and unloads
  (out of the catalog at once; each loop unloads it from its runner once nothing of it runs).
- `RunnerAdapters`: one runner loop's view of what its runner holds. Its loop's thread calls
  `sync` before every step, so a runner that joins later or restarts (new epoch: its adapters
  are gone with its memory) gets every catalog adapter loaded before work is scheduled on it.

KV isolation: a sequence's KV is only valid under the adapter that computed it, so an adapter
request's cache salt (the block service's prefix-hash seed) folds in the adapter's digest
(`effective_salt`): two adapters, an adapter and the base, or a name reloaded with other files
never share a cached block. Base requests keep the client's salt as it is.
"""

from __future__ import annotations

import hashlib
import logging
import re
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

import grpc

from gateway import metrics
from gateway.validation import ADAPTER_SALT_PREFIX
from protos import runner_pb2, runner_pb2_grpc

log = logging.getLogger(__name__)

# gateway.proto LoadLoraAdapterRequest.lora_name (and runner.proto's LoadAdapterRequest.name).
NAME_PATTERN = re.compile(r"[A-Za-z0-9._:/-]{1,128}")


class AdapterError(Exception):
    """A load or unload refused: a gRPC status code name, a message, and the request field
    at fault (the HTTP API maps the code onto its status and names the field)."""

    def __init__(self, code_name: str, message: str, field: str = "lora_name") -> None:
        super().__init__(message)
        self.code_name = code_name
        self.message = message
        self.field = field


class UnknownModel(Exception):
    """A request names a model that is neither the base model nor a served adapter."""


@dataclass(frozen=True)
class Adapter:
    """A LoRA adapter served on top of the base model."""

    name: str
    path: str
    rank: int
    digest: str  # of its config and weights, as the runners reported it (runner.proto)


def effective_salt(user_salt: str, adapter: Adapter | None) -> str:
    """The cache salt a request's prefixes are hashed under: the client's for the base model;
    for an adapter, its digest and (hashed, so that the whole stays short of the block
    service's MAX_CACHE_SALT_BYTES) the client's salt."""
    if adapter is None:
        return user_salt
    digest = adapter.digest
    if len(digest) > 128:  # a runner's digest is a hex hash; keep the salt bounded anyway
        digest = hashlib.sha256(digest.encode()).hexdigest()
    salt = ADAPTER_SALT_PREFIX + digest
    if user_salt:
        salt += ":" + hashlib.sha256(user_salt.encode("utf-8", "surrogatepass")).hexdigest()
    return salt


class AdapterCatalog:
    """The adapters this gateway serves, by name (any thread)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._adapters: dict[str, Adapter] = {}  # in load order
        self.version = 0  # changes with every change: loops compare it before each step

    def get(self, name: str) -> Adapter | None:
        return self._adapters.get(name)

    def list(self) -> list[Adapter]:
        with self._lock:
            return list(self._adapters.values())

    def put(self, adapter: Adapter) -> None:
        with self._lock:
            self._adapters[adapter.name] = adapter
            self.version += 1
        metrics.ADAPTERS_SERVED.set(len(self._adapters))

    def remove(self, name: str) -> Adapter | None:
        with self._lock:
            adapter = self._adapters.pop(name, None)
            self.version += 1
        metrics.ADAPTERS_SERVED.set(len(self._adapters))
        return adapter


@dataclass(frozen=True)
class ModelNames:
    """The names a request's `model` may give: the base model's (`name`, its `aliases`, or
    none) and the catalog's adapters."""

    name: str
    aliases: frozenset[str] = frozenset()
    catalog: AdapterCatalog = field(default_factory=AdapterCatalog)

    def is_base(self, asked: str) -> bool:
        return not asked or asked == self.name or asked in self.aliases

    def resolve(self, asked: str) -> Adapter | None:
        """None for the base model, else the adapter named; UnknownModel otherwise."""
        if self.is_base(asked):
            return None
        adapter = self.catalog.get(asked)
        if adapter is None:
            served = [self.name, *(a.name for a in self.catalog.list())]
            raise UnknownModel(f"the model {asked[:64]!r} does not exist; this server serves "
                               f"{', '.join(repr(n) for n in served)}")
        return adapter

    def names(self, asked: str) -> bool:
        return self.is_base(asked) or self.catalog.get(asked) is not None


class AdapterLoop(Protocol):
    """What AdapterAdmin needs of a runner loop (gateway/runner_loop.py RunnerLoop)."""

    address: str

    @property
    def max_loras(self) -> int: ...

    @property
    def adapters(self) -> RunnerAdapters: ...

    def unload_adapter(self, name: str) -> None: ...


class RunnerAdapters:
    """What one runner holds of the catalog; calls its runner (LoadAdapter, UnloadAdapter).

    `load` and `retire` may come from any thread; `sync` and `reset` from the loop's only."""

    def __init__(self, catalog: AdapterCatalog, runner: runner_pb2_grpc.RunnerServiceStub,
                 runner_name: str, timeout_s: float, holder: str = "") -> None:
        """`holder`: this gateway's name on the runner (runner.proto's holder: another
        gateway's unload leaves its adapters loaded)."""
        self._catalog = catalog
        self._holder = holder
        self._runner = runner
        self._runner_name = runner_name
        self._timeout_s = timeout_s
        self._lock = threading.Lock()
        self._loaded: dict[str, str] = {}  # name -> digest, on the runner at this epoch
        self._failed: dict[str, str] = {}  # catalog names the runner refused (this epoch): why
        self._draining: set[str] = set()  # out of the catalog, still loaded: unload when unused
        self._synced_version = -1

    def is_loaded(self, name: str) -> bool:
        return name in self._loaded

    def failure(self, name: str) -> str:
        """Why this runner could not load a catalog adapter ("" when it did, or was not
        asked to yet)."""
        return self._failed.get(name, "")

    def load(self, name: str, path: str) -> runner_pb2.AdapterInfo:
        """Loads an adapter on the runner (grpc.RpcError as the runner refused it)."""
        reply = self._runner.LoadAdapter(runner_pb2.LoadAdapterRequest(name=name, path=path,
                                                                       holder=self._holder),
                                         timeout=self._timeout_s)
        with self._lock:
            self._loaded[name] = reply.adapter.digest
            self._failed.pop(name, None)
            self._draining.discard(name)
        return reply.adapter

    def drop(self, name: str) -> None:
        """Unloads now (a load that failed elsewhere is undone); a failure is only logged."""
        with self._lock:
            self._loaded.pop(name, None)
        self._unload(name)

    def retire(self, name: str) -> None:
        """The catalog no longer has `name`: unload it once nothing running here uses it."""
        with self._lock:
            # Whatever its state: a load still under way may finish after this.
            self._draining.add(name)
            self._failed.pop(name, None)

    def reset(self) -> None:
        """The runner restarted (new epoch): it holds no adapter any more."""
        with self._lock:
            self._loaded.clear()
            self._failed.clear()
            self._draining.clear()
            self._synced_version = -1

    def sync(self, in_use: Callable[[], set[str]]) -> bool:
        """Loads the catalog adapters the runner lacks, and unloads drained ones that no
        sequence here uses any more (`in_use`: the adapter names of the loop's live work).
        True when the catalog was gone through (after a change or a reset): the loop then
        ends requests whose adapter its runner does not hold."""
        version = self._catalog.version
        checked = version != self._synced_version
        if checked:
            self._synced_version = version
            for adapter in self._catalog.list():
                if adapter.name not in self._loaded and adapter.name not in self._failed:
                    self._load_catalog_adapter(adapter)
        if self._draining:
            used = in_use()
            for name in [n for n in self._draining if n not in used]:
                with self._lock:
                    if name not in self._draining:  # loaded again meanwhile
                        continue
                    self._draining.discard(name)
                    self._loaded.pop(name, None)
                self._unload(name)
        return checked

    def _load_catalog_adapter(self, adapter: Adapter) -> None:
        try:
            info = self.load(adapter.name, adapter.path)
        except grpc.RpcError as error:
            why = f"{error.code().name}: {error.details()}"  # type: ignore[attr-defined]
            log.error("%s could not load adapter %s from %s: %s", self._runner_name,
                      adapter.name, adapter.path, why)
            with self._lock:
                self._failed[adapter.name] = why
            return
        if self._catalog.get(adapter.name) is None:  # unloaded while it loaded here
            self.retire(adapter.name)
            return
        if info.digest != adapter.digest:  # other files under that path on this runner
            log.error("%s loaded adapter %s with digest %s, not %s: not serving it there",
                      self._runner_name, adapter.name, info.digest, adapter.digest)
            self.drop(adapter.name)
            with self._lock:
                self._failed[adapter.name] = "its files differ from the other runners'"
            return
        log.info("%s: loaded adapter %s", self._runner_name, adapter.name)

    def _unload(self, name: str) -> None:
        try:
            self._runner.UnloadAdapter(runner_pb2.UnloadAdapterRequest(name=name,
                                                                       holder=self._holder),
                                       timeout=self._timeout_s)
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.NOT_FOUND:  # type: ignore[attr-defined]
                log.warning("%s: unloading adapter %s failed: %s", self._runner_name, name,
                            error.code())  # type: ignore[attr-defined]


class AdapterAdmin:
    """Loads and unloads adapters for the whole gateway (the AdminService and the HTTP API's
    /v1/load_lora_adapter and /v1/unload_lora_adapter both call it)."""

    def __init__(self, names: ModelNames, loops: Callable[[], Iterable[AdapterLoop]]) -> None:
        """`names`: the served names (its catalog is the one changed); `loops`: the runner
        loops now."""
        self.names = names
        self.catalog = names.catalog
        self._loops = loops
        self._lock = threading.Lock()  # one load or unload at a time

    def load(self, name: str, path: str) -> Adapter:
        """Loads `name` from `path` on every runner and serves it (AdapterError: nothing
        changed)."""
        self._check_name(name)
        if not path:
            raise AdapterError("INVALID_ARGUMENT", "lora_path is empty", "lora_path")
        with self._lock:
            try:
                adapter = self._load_everywhere(name, path)
            except AdapterError:
                metrics.ADAPTER_LOADS.labels("failed").inc()
                raise
            self.catalog.put(adapter)
        metrics.ADAPTER_LOADS.labels("loaded").inc()
        log.info("serving LoRA adapter %s (rank %d) from %s", name, adapter.rank, path)
        return adapter

    def unload(self, name: str) -> None:
        """Stops serving `name` at once; each runner unloads it once its running sequences
        are done (AdapterError NOT_FOUND for an unknown name)."""
        if not name:
            raise AdapterError("INVALID_ARGUMENT", "lora_name is empty")
        with self._lock:
            if self.catalog.remove(name) is None:
                raise AdapterError("NOT_FOUND", f"no LoRA adapter named {name[:128]!r} is "
                                                f"served")
            for loop in self._loops():
                loop.unload_adapter(name)
        metrics.ADAPTER_UNLOADS.inc()
        log.info("stopped serving LoRA adapter %s", name)

    def _check_name(self, name: str) -> None:
        if not name:
            raise AdapterError("INVALID_ARGUMENT", "lora_name is empty")
        if not NAME_PATTERN.fullmatch(name):
            raise AdapterError("INVALID_ARGUMENT",
                               f"lora_name {name[:128]!r}: give 1 to 128 characters of "
                               f"A-Z a-z 0-9 . _ : / -")
        if self.names.is_base(name):
            raise AdapterError("FAILED_PRECONDITION", f"lora_name {name!r} is the base "
                                                      f"model's name")

    def _load_everywhere(self, name: str, path: str) -> Adapter:
        """LoadAdapter on every loop's runner; on a refusal, unloads it from those that had
        not held it before and raises the runner's code and message."""
        loops = list(self._loops())
        if not loops:
            raise AdapterError("UNAVAILABLE", "no runner is serving: nothing to load it on")
        for loop in loops:
            if loop.max_loras == 0:
                raise AdapterError("FAILED_PRECONDITION",
                                   f"runner {loop.address} serves no LoRA adapters: start it "
                                   f"with --max-loras N (N > 0)")
        took: list[tuple[AdapterLoop, bool]] = []  # (loop, whether it was loaded before)
        infos: list[runner_pb2.AdapterInfo] = []
        for loop in loops:
            before = loop.adapters.is_loaded(name)
            try:
                infos.append(loop.adapters.load(name, path))
            except grpc.RpcError as error:
                _undo(took, name)
                code = error.code()  # type: ignore[attr-defined]
                details = error.details()  # type: ignore[attr-defined]
                raise AdapterError(code.name, f"runner {loop.address}: {details}",
                                   "lora_path") from None
            took.append((loop, before))
        digests = {info.digest for info in infos}
        if len(digests) > 1:
            _undo(took, name)
            raise AdapterError("FAILED_PRECONDITION",
                               f"the runners read different files at {path}: give a path "
                               f"that holds the same adapter on every runner", "lora_path")
        info = infos[0]
        return Adapter(name, path, info.rank, info.digest)


def _undo(took: list[tuple[AdapterLoop, bool]], name: str) -> None:
    """A failed load's undoing: where it was new, unloaded now; where it was loaded before
    (draining after an unload), back to draining (unloaded once unused)."""
    for loop, before in took:
        if before:
            loop.adapters.retire(name)
        else:
            loop.adapters.drop(name)
