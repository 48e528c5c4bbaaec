"""A stand-in runner for gateway tests: a "model" whose KV cache holds token ids.

It checks every batch the way a real runner relies on it (slots where the block table says,
tables covering every position, copies before writes) and "predicts" the next token from the
context it READS BACK FROM ITS CACHE through the block table. So a gateway that sends a wrong
slot, table or copy gets different tokens than `next_token(true context)`, which the tests
compute independently as their oracle.

LoRA adapters: LoadAdapter takes a folder holding adapter_config.json (its "r" is the rank;
the digest is a hash of the folder's files), and a row run through an adapter gets
`adapter_token(next_token(...), digest)`, so a test sees which adapter ran each sequence.
Each batch's adapters column is recorded as sent (`adapter_columns`).
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np

from gpu_runner.masks import MaskBoard, MissingMasks, words_per_row
from gpu_runner.merging import BatchError, BatchMerger, PartialFailure, PendingStepError
from protos import runner_pb2, runner_pb2_grpc

VOCAB = 49152
EOS = 2
_EMPTY = -1


def next_token(context: Sequence[int], seed: int | None, vocab: int = VOCAB) -> int:
    """The fake model: a hash of the whole context (and the seed when sampling).

    Tokens 0..15 (EOS among them) are never produced, so generation runs to max_tokens.
    """
    value = len(context) * 1_000_003
    for position, token in enumerate(context):
        value = (value * 31 + token * (position + 7)) % (1 << 61)
    if seed is not None:
        value = (value ^ (seed * 0x9E3779B97F4A7C15 + len(context))) % (1 << 61)
    return 16 + value % (vocab - 16)


def adapter_token(token: int, digest: str, vocab: int = VOCAB) -> int:
    """The fake model's token for a row run through the adapter of `digest` ("": base)."""
    if not digest:
        return token
    return 16 + (token * 7 + int(digest[:12], 16)) % (vocab - 16)


def folder_digest(path: Path) -> str:
    """The fake's adapter digest: a hash of the folder's files, names and contents."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.iterdir() if p.is_file()):
        digest.update(file.name.encode() + b"\0" + file.read_bytes())
    return digest.hexdigest()


def make_adapter(folder: Path, rank: int = 8, weights: bytes = b"weights") -> Path:
    """A folder the fake runner loads as an adapter (any `weights` make another digest)."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(
        {"r": rank, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]}))
    (folder / "adapter_model.safetensors").write_bytes(weights)
    return folder


@dataclass
class FakeAdapter:
    name: str
    path: str
    rank: int
    digest: str


class FakeRunner(runner_pb2_grpc.RunnerServiceServicer):
    """Executes batches against a cache of token ids; records what it saw."""

    def __init__(self, num_blocks: int, block_size: int, max_model_len: int = 2048,
                 epoch: int = 7, max_loras: int = 0, max_lora_rank: int = 16) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.epoch = epoch
        self.cache = np.full(num_blocks * block_size, _EMPTY, dtype=np.int64)
        self.batches: list[runner_pb2.ExecuteRequest] = []  # each client's, as sent
        self.forwards: list[runner_pb2.ExecuteRequest] = []  # what ran: merged batches
        self.lock = threading.Lock()
        # As the real runner's: clients' batches waiting together run as one forward; a
        # step sent while its previous one runs waits for it and takes its pending tokens.
        self.merger = BatchMerger()
        self.proceed = threading.Event()  # cleared: Execute waits (a busy runner)
        self.proceed.set()
        # Sampled rows whose penalty history was checked against the cache, and the first
        # history that disagreed with it (the model ignores penalties; the gateway's packing
        # of them is checked here).
        self.penalty_rows = 0
        self.penalty_error = ""
        # Structured output: late masks, and how many rows were sampled under a mask (the
        # fake model picks an allowed token: its hash indexes the 8 of lowest id, mostly
        # single characters, so that strings and numbers end soon).
        self.mask_board = MaskBoard(wait_s=5.0)
        self.masked_rows = 0
        # LoRA: the slot table's size (0: no adapters), the adapters loaded by name, and
        # each batch's adapters column as sent (empty: all base).
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.adapters: dict[str, FakeAdapter] = {}
        self.adapter_columns: list[list[str]] = []
        self.adapter_calls: list[tuple[str, str]] = []  # ("load" | "unload", name)

    def restart(self, epoch: int) -> None:
        """As a runner process that started again: a new epoch, no KV, no adapters."""
        with self.lock:
            self.epoch = epoch
            self.cache[:] = _EMPTY
            self.adapters.clear()

    def Info(self, request: runner_pb2.InfoRequest, context: grpc.ServicerContext
             ) -> runner_pb2.InfoResponse:
        return runner_pb2.InfoResponse(
            model="fake", architecture="FakeForCausalLM", vocab_size=VOCAB,
            eos_token_ids=[EOS], max_model_len=self.max_model_len, num_blocks=self.num_blocks,
            block_size=self.block_size, dtype="float32", device="cpu", epoch=self.epoch,
            attention_backend="torch", tensor_parallel_size=1, max_loras=self.max_loras,
            max_lora_rank=self.max_lora_rank,
        )

    def LoadAdapter(self, request: runner_pb2.LoadAdapterRequest,
                    context: grpc.ServicerContext) -> runner_pb2.LoadAdapterResponse:
        if self.max_loras == 0:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "serves no adapters")
        folder = Path(request.path)
        config_file = folder / "adapter_config.json"
        if not config_file.is_file():
            context.abort(grpc.StatusCode.NOT_FOUND, f"no adapter_config.json in {folder}")
        try:
            rank = int(json.loads(config_file.read_text())["r"])
        except (ValueError, KeyError, TypeError):
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "corrupt adapter_config.json")
        if rank > self.max_lora_rank:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"rank {rank} is over --max-lora-rank {self.max_lora_rank}")
        digest = folder_digest(folder)
        with self.lock:
            held = self.adapters.get(request.name)
            if held is not None and held.digest != digest:
                context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                              f"{request.name} is taken by other files")
            adapter = self.adapters[request.name] = FakeAdapter(
                request.name, request.path, rank, digest)
            self.adapter_calls.append(("load", request.name))
        return runner_pb2.LoadAdapterResponse(adapter=self._adapter_info(adapter))

    def UnloadAdapter(self, request: runner_pb2.UnloadAdapterRequest,
                      context: grpc.ServicerContext) -> runner_pb2.UnloadAdapterResponse:
        with self.lock:
            if self.adapters.pop(request.name, None) is None:
                context.abort(grpc.StatusCode.NOT_FOUND, f"no adapter {request.name}")
            self.adapter_calls.append(("unload", request.name))
        return runner_pb2.UnloadAdapterResponse()

    def ListAdapters(self, request: runner_pb2.ListAdaptersRequest,
                     context: grpc.ServicerContext) -> runner_pb2.ListAdaptersResponse:
        with self.lock:
            adapters = [self._adapter_info(a) for a in self.adapters.values()]
        return runner_pb2.ListAdaptersResponse(adapters=adapters, max_loras=self.max_loras,
                                               max_lora_rank=self.max_lora_rank)

    @staticmethod
    def _adapter_info(adapter: FakeAdapter) -> runner_pb2.AdapterInfo:
        return runner_pb2.AdapterInfo(name=adapter.name, path=adapter.path, rank=adapter.rank,
                                      target_modules=["q_proj", "v_proj"],
                                      digest=adapter.digest)

    def Execute(self, request: runner_pb2.ExecuteRequest, context: grpc.ServicerContext
                ) -> runner_pb2.ExecuteResponse:
        self.proceed.wait(30)
        if request.epoch != self.epoch:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, "stale epoch")
        try:
            return self.merger.run(request, self._check_one, self._forward)
        except PendingStepError as error:
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(error))
        except BatchError as error:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(error))
        raise AssertionError("unreachable: abort raises")

    def SupplyMasks(self, request: runner_pb2.SupplyMasksRequest,
                    context: grpc.ServicerContext) -> runner_pb2.SupplyMasksResponse:
        self.mask_board.put(request.client_id, request.step_id, request.masks)
        return runner_pb2.SupplyMasksResponse()

    def _check_one(self, request: runner_pb2.ExecuteRequest) -> None:
        """In the batch's turn, its pending tokens filled in."""
        with self.lock:
            self.batches.append(request)
            self.adapter_columns.append(list(request.adapters))
        error = self._check(request)
        if error:
            raise BatchError(error)

    def _forward(self, merged: runner_pb2.ExecuteRequest,
                 parts: list[runner_pb2.ExecuteRequest]) -> runner_pb2.ExecuteResponse:
        failed: dict[int, BaseException] = {}
        masks = self._masks(parts, failed)  # outside the lock: late ones may still come
        with self.lock:
            self.forwards.append(merged)
            error = self._check(merged)  # the merge must keep every row's slots and table
            if error:
                raise BatchError(f"merged batch: {error}")
            answer = self._run(merged, masks)
            if failed:
                raise PartialFailure(answer, failed)
            if self.penalty_error:
                raise BatchError(self.penalty_error)
            return answer

    def _check(self, request: runner_pb2.ExecuteRequest) -> str:
        n = len(request.num_new_tokens)
        columns = [request.start_positions, request.block_table_lens, request.do_sample,
                   request.temperatures, request.top_ps, request.top_ks, request.min_ps,
                   request.seeds]
        if any(len(c) != n for c in columns):
            return "column lengths differ"
        if not sum(request.num_new_tokens) == len(request.token_ids) == len(request.slot_mapping):
            return "token and slot counts differ"
        if sum(request.block_table_lens) != len(request.block_tables):
            return "block table lengths differ"
        if request.adapters:
            if len(request.adapters) != n:
                return "adapters column length differs"
            named = {name for name in request.adapters if name}
            if len(named) > self.max_loras:
                return f"{len(named)} adapters in one batch, over max_loras {self.max_loras}"
            if not named <= set(self.adapters):
                return f"adapters not loaded: {sorted(named - set(self.adapters))}"
        token_cursor = table_cursor = 0
        for i in range(n):
            count, start = request.num_new_tokens[i], request.start_positions[i]
            table = request.block_tables[table_cursor:table_cursor + request.block_table_lens[i]]
            if len(table) * self.block_size < start + count:
                return f"sequence {i}: table too short"
            for j in range(count):
                position = start + j
                expected = table[position // self.block_size] * self.block_size + (
                    position % self.block_size)
                if request.slot_mapping[token_cursor + j] != expected:
                    return f"sequence {i}: slot of position {position} is not its table's"
            token_cursor += count
            table_cursor += request.block_table_lens[i]
        return ""

    def _masks(self, parts: list[runner_pb2.ExecuteRequest],
               failed: dict[int, BaseException]) -> dict[int, np.ndarray]:
        """Merged sequence index -> its allowed token ids."""
        words = words_per_row(VOCAB)
        allowed: dict[int, np.ndarray] = {}
        offset = 0
        for i, part in enumerate(parts):
            data = part.masks
            if not part.mask_seq_indices:
                offset += len(part.num_new_tokens)
                continue
            if part.masks_follow:
                try:
                    data = self.mask_board.take(part.client_id, part.step_id)
                except MissingMasks as error:
                    failed[i] = PendingStepError(str(error))
                    data = b""
            if len(data) == len(part.mask_seq_indices) * words * 4:
                rows = np.frombuffer(data, dtype=np.uint8).reshape(len(part.mask_seq_indices), -1)
                bits = np.unpackbits(rows, axis=1, bitorder="little")[:, :VOCAB]
                for j, seq in enumerate(part.mask_seq_indices):
                    allowed[offset + seq] = np.nonzero(bits[j])[0]
            offset += len(part.num_new_tokens)
        return allowed

    def _run(self, request: runner_pb2.ExecuteRequest,
             masks: dict[int, np.ndarray] | None = None) -> runner_pb2.ExecuteResponse:
        for src, dst in zip(request.copy_src_block_ids, request.copy_dst_block_ids,
                            strict=True):
            bs = self.block_size
            self.cache[dst * bs:(dst + 1) * bs] = self.cache[src * bs:(src + 1) * bs]
        self.cache[list(request.slot_mapping)] = list(request.token_ids)
        reply = runner_pb2.ExecuteResponse(epoch=self.epoch)
        table_cursor = 0
        for i, count in enumerate(request.num_new_tokens):
            table = request.block_tables[table_cursor:table_cursor + request.block_table_lens[i]]
            table_cursor += request.block_table_lens[i]
            if not request.do_sample[i]:
                continue
            length = request.start_positions[i] + count
            positions = np.arange(length)
            slots = np.asarray(table)[positions // self.block_size] * self.block_size + (
                positions % self.block_size)
            context = [int(t) for t in self.cache[slots]]
            self._check_penalty_history(request, i, context)
            seed = None if request.temperatures[i] == 0 else int(request.seeds[i])
            token = next_token(context, seed)
            if request.adapters and request.adapters[i]:
                token = adapter_token(token, self.adapters[request.adapters[i]].digest)
            if masks and i in masks and masks[i].size:
                token = int(masks[i][token % min(8, masks[i].size)])
                self.masked_rows += 1
            reply.token_ids.append(token)
            if request.num_logprobs:
                reply.logprobs.append(-0.5)
                k = request.num_logprobs[i]
                reply.top_counts.append(k)
                reply.top_token_ids.extend(token + j for j in range(k))
                reply.top_logprobs.extend(-0.5 - j for j in range(k))
        return reply

    def _check_penalty_history(self, request: runner_pb2.ExecuteRequest, row: int,
                               context: list[int]) -> None:
        """A sampled row with a penalty on must carry its whole history before this step."""
        if not request.penalty_history_lens:
            return
        penalised = (request.presence_penalties[row] != 0
                     or request.frequency_penalties[row] != 0
                     or request.repetition_penalties[row] != 1)
        lens = request.penalty_history_lens
        if not penalised:
            if lens[row]:
                self.penalty_error = f"row {row}: history sent without a penalty"
            return
        start = request.start_positions[row]
        offset = sum(lens[:row])
        history = list(request.penalty_token_ids[offset:offset + lens[row]])
        if lens[row] != start or history != context[:start]:
            self.penalty_error = f"row {row}: penalty history is not the sequence's tokens"
        self.penalty_rows += 1


def expected_tokens(prompt: Sequence[int], max_tokens: int, seed: int | None = None,
                    digest: str = "") -> list[int]:
    """The oracle: what the fake model generates for `prompt` alone (through the adapter of
    `digest` when given)."""
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(adapter_token(next_token(context, seed), digest))
    return context[len(prompt):]
