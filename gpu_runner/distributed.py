"""Tensor parallelism over torch.distributed (NCCL on GPUs, gloo on CPUs).

Layout (Megatron style): q/k/v and gate/up are column-parallel (each rank holds a contiguous
slice of the heads and of the intermediate features), o and down are row-parallel (each rank
multiplies its slice and an all-reduce sums the partial outputs), the embedding and the LM
head are vocab-parallel (each rank holds a slice of the vocabulary; embedding rows are
summed by an all-reduce, logits gathered). KV heads are split across ranks, so the number of
KV heads must divide by the tensor-parallel size.

Processes: rank 0 is the gRPC server. It spawns ranks 1..N-1 (`worker_main`) before loading
the model, and before every forward broadcasts the batch on a gloo control group; workers
run the same forward on their shards (their sampled tokens are discarded). A monitor thread
on rank 0 notices a worker that exits and reports it (the runner turns NOT_SERVING).
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import torch
import torch.distributed as dist
from torch.nn import functional as F

from gpu_runner.config import ModelConfig, load_model_config
from gpu_runner.layers.embedding import Embedding, LMHead
from gpu_runner.layers.linear import Linear

if TYPE_CHECKING:
    from gpu_runner.attention.selection import AttentionBackend
    from gpu_runner.models.llama import DecoderLayer, LlamaForCausalLM

log = logging.getLogger(__name__)

# How long a collective may wait for a peer before failing (a dead peer usually fails fast).
COLLECTIVE_TIMEOUT = timedelta(seconds=120)
STOP = "stop"


class TensorParallelError(ValueError):
    """The model cannot be split over the requested number of ranks."""


class WorkerLostError(RuntimeError):
    """A tensor-parallel worker has exited: the runner can no longer execute (UNAVAILABLE)."""


@dataclass(frozen=True)
class ShardSpec:
    """Which shard a process holds."""

    rank: int
    world_size: int

    def vocab_range(self, vocab_size: int) -> tuple[int, int]:
        """[start, end) of this rank's vocabulary rows (the last shard may be shorter)."""
        per_rank = -(-vocab_size // self.world_size)
        start = min(self.rank * per_rank, vocab_size)
        return start, min(start + per_rank, vocab_size)

    def vocab_shard_rows(self, vocab_size: int) -> int:
        """Rows each rank allocates (equal on every rank, so logits can be all-gathered)."""
        return -(-vocab_size // self.world_size)


def check_tensor_parallel(config: ModelConfig, world_size: int) -> None:
    """Raises TensorParallelError when `config` cannot be split over `world_size` ranks."""
    if world_size < 1:
        raise TensorParallelError(f"--tensor-parallel-size must be >= 1; got {world_size}")
    for name, value in (("num_key_value_heads", config.num_kv_heads),
                        ("num_attention_heads", config.num_heads),
                        ("intermediate_size", config.intermediate_size)):
        if value % world_size:
            raise TensorParallelError(
                f"--tensor-parallel-size {world_size} must divide the model's {name} "
                f"({value}): each rank holds an equal share of them")


def local_config(config: ModelConfig, world_size: int) -> ModelConfig:
    """The shapes of one rank's shard (heads and MLP width divided; vocab handled apart)."""
    check_tensor_parallel(config, world_size)
    return dataclasses.replace(
        config,
        num_heads=config.num_heads // world_size,
        num_kv_heads=config.num_kv_heads // world_size,
        intermediate_size=config.intermediate_size // world_size,
    )


# ---- parallel layers ----


class RowParallelLinear(Linear):
    """y = sum over ranks of x_rank @ W_rank^T (an all-reduce), plus the bias once."""

    def __init__(self, in_features: int, out_features: int, group: Any,
                 bias: bool = False) -> None:
        super().__init__(in_features, out_features, bias)
        self.group = group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight)
        dist.all_reduce(out, group=self.group)
        return out if self.bias is None else out.add_(self.bias)


class VocabParallelEmbedding(Embedding):
    """Each rank looks up the ids in its vocabulary slice (zeros elsewhere); an all-reduce
    sums the ranks' rows into the full embedding."""

    def __init__(self, shard_rows: int, hidden_size: int, vocab_start: int, vocab_end: int,
                 group: Any) -> None:
        super().__init__(shard_rows, hidden_size)
        self.vocab_start = vocab_start
        self.vocab_end = vocab_end
        self.group = group

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        mine = (token_ids >= self.vocab_start) & (token_ids < self.vocab_end)
        local = torch.where(mine, token_ids - self.vocab_start, 0)
        rows = F.embedding(local, self.weight)
        rows.mul_(mine.unsqueeze(-1).to(rows.dtype))
        dist.all_reduce(rows, group=self.group)
        return rows


class ParallelLMHead(LMHead):
    """Each rank computes the logits of its vocabulary slice; an all-gather joins them."""

    def __init__(self, shard_rows: int, hidden_size: int, vocab_size: int, world_size: int,
                 group: Any) -> None:
        super().__init__(shard_rows, hidden_size)
        self.vocab_size = vocab_size
        self.world_size = world_size
        self.group = group

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        local = F.linear(hidden, self.weight).contiguous()
        parts = [torch.empty_like(local) for _ in range(self.world_size)]
        dist.all_gather(parts, local, group=self.group)
        # Shards are padded to equal rows: drop the padding past the real vocabulary.
        return torch.cat(parts, dim=-1)[..., : self.vocab_size]


def parallelize(model: LlamaForCausalLM, config: ModelConfig, shard: ShardSpec, group: Any
                ) -> None:
    """Replaces the row-parallel and vocab-parallel modules of a model built from
    local_config (their weights are assigned afterwards by `load_sharded_weights`)."""
    local = local_config(config, shard.world_size)
    for module in model.layers:
        layer = cast("DecoderLayer", module)
        layer.self_attn.o_proj = RowParallelLinear(local.q_size, config.hidden_size, group)
        layer.mlp.down_proj = RowParallelLinear(local.intermediate_size, config.hidden_size,
                                                group)
    rows = shard.vocab_shard_rows(config.vocab_size)
    start, end = shard.vocab_range(config.vocab_size)
    model.embed_tokens = VocabParallelEmbedding(rows, config.hidden_size, start, end, group)
    model.lm_head = ParallelLMHead(rows, config.hidden_size, config.vocab_size,
                                   shard.world_size, group)


# ---- weights ----


def shard_tensor(name: str, tensor: torch.Tensor, config: ModelConfig, shard: ShardSpec
                 ) -> torch.Tensor:
    """This rank's part of the full (fused) parameter `name`."""
    tp, rank = shard.world_size, shard.rank
    if ".qkv_proj." in name:
        parts = tensor.split([config.q_size, config.kv_size, config.kv_size], dim=0)
        return torch.cat([part.chunk(tp, dim=0)[rank] for part in parts])
    if ".gate_up_proj." in name:
        parts = tensor.split([config.intermediate_size, config.intermediate_size], dim=0)
        return torch.cat([part.chunk(tp, dim=0)[rank] for part in parts])
    if ".o_proj.weight" in name or ".down_proj.weight" in name:
        return tensor.chunk(tp, dim=1)[rank].contiguous()
    if name in ("embed_tokens.weight", "lm_head.weight"):
        start, end = shard.vocab_range(config.vocab_size)
        rows = tensor.new_zeros(shard.vocab_shard_rows(config.vocab_size), tensor.shape[1])
        rows[: end - start] = tensor[start:end]
        return rows
    return tensor


def load_sharded_weights(model: LlamaForCausalLM, folder: Path, config: ModelConfig,
                         shard: ShardSpec, dtype: torch.dtype) -> None:
    """Streams the checkpoint's tensors, keeping only this rank's shard of each."""
    from gpu_runner.loader import WeightLoadError, _fused_tensors, _TensorIndex

    params = dict(model.named_parameters(remove_duplicate=False))
    assigned: set[str] = set()
    for name, tensor in _fused_tensors(_TensorIndex(folder), config):
        if name not in params:
            continue
        part = shard_tensor(name, tensor, config, shard)
        param = params[name]
        if tuple(part.shape) != tuple(param.shape):
            raise WeightLoadError(f"shard of {name!r} has shape {tuple(part.shape)}, "
                                  f"expected {tuple(param.shape)}")
        param.data = part.to(device=param.device, dtype=dtype)
        assigned.add(name)
    missing = sorted(set(params) - assigned)
    if missing:
        raise WeightLoadError(f"no weight produced for {missing[:5]}")
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight


def build_sharded_model(folder: Path, device: torch.device, dtype: torch.dtype,
                        shard: ShardSpec, group: Any,
                        make_backend: Callable[[ModelConfig], AttentionBackend]
                        ) -> tuple[LlamaForCausalLM, ModelConfig, ModelConfig]:
    """(model, full config, this rank's local config) for the checkpoint in `folder`."""
    from gpu_runner.models.registry import model_class

    config = load_model_config(folder)
    local = local_config(config, shard.world_size)
    with torch.device(device):
        model = model_class(config.architecture)(local, make_backend(local))
        parallelize(model, config, shard, group)
    load_sharded_weights(model, folder, config, shard, dtype)
    model.eval()
    return model, config, local


# ---- processes ----


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class TensorParallelGroup:
    """This process's membership: its shard, the compute group of the collectives inside
    the model, and the gloo control group carrying batches from rank 0."""

    shard: ShardSpec
    compute_group: Any
    control_group: Any

    def broadcast(self, message: object) -> object:
        """Rank 0 sends `message`; every rank returns it."""
        holder = [message if self.shard.rank == 0 else None]
        dist.broadcast_object_list(holder, src=0, group=self.control_group)
        return holder[0]

    def min_over_ranks(self, value: int) -> int:
        """The smallest `value` of all ranks (cache sizes must agree)."""
        tensor = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self.control_group)
        return int(tensor.item())

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()


def join_group(rank: int, world_size: int, port: int, device: torch.device
               ) -> TensorParallelGroup:
    """Joins the process group at 127.0.0.1:port (blocks until every rank has joined)."""
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=world_size, timeout=COLLECTIVE_TIMEOUT)
    compute = dist.group.WORLD
    control = dist.new_group(backend="gloo") if backend != "gloo" else compute
    return TensorParallelGroup(ShardSpec(rank, world_size), compute, control)


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank r uses the r-th CUDA device from the one asked for (one GPU per rank: "cuda:2"
    with 2 ranks uses cuda:2 and cuda:3); CPU ranks share the CPU."""
    if device.type == "cuda":
        return torch.device("cuda", (device.index or 0) + rank)
    return device


@dataclass
class WorkerSet:
    """Rank 0's handle on the worker processes: liveness, failure callbacks, shutdown."""

    processes: list[Any]
    failure: str | None = None
    stopping: bool = False
    _callbacks: list[Callable[[str], None]] = field(default_factory=list)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def start_monitor(self) -> None:
        threading.Thread(target=self._watch, name="tp-worker-monitor", daemon=True).start()

    def _watch(self) -> None:
        sentinels = {proc.sentinel: rank for rank, proc in enumerate(self.processes, start=1)}
        ready = multiprocessing.connection.wait(list(sentinels))
        if self.stopping:
            return
        rank = sentinels[ready[0]]
        code = self.processes[rank - 1].exitcode
        self._fail(f"tensor-parallel worker rank {rank} exited (code {code})")

    def _fail(self, reason: str) -> None:
        with self._lock:
            if self.failure is not None:
                return
            self.failure = reason
            callbacks = list(self._callbacks)
        log.error("%s: the runner stops serving", reason)
        for callback in callbacks:
            callback(reason)

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Calls `callback(reason)` when a worker dies (at once if one already has)."""
        with self._lock:
            self._callbacks.append(callback)
            failure = self.failure
        if failure is not None:
            callback(failure)

    def stop(self, timeout_s: float = 10.0) -> None:
        self.stopping = True
        for proc in self.processes:
            proc.join(timeout_s)
        for proc in self.processes:
            if proc.is_alive():
                proc.terminate()
                proc.join(timeout_s)


def spawn_workers(target: Callable[..., None], args_of_rank: Callable[[int], tuple[Any, ...]],
                  world_size: int) -> WorkerSet:
    """Starts ranks 1..world_size-1 as spawned processes running target(*args_of_rank(r))."""
    context = multiprocessing.get_context("spawn")
    processes = []
    for rank in range(1, world_size):
        proc = context.Process(target=target, args=args_of_rank(rank), daemon=True,
                               name=f"tp-worker-{rank}")
        proc.start()
        log.info("tensor-parallel worker rank %d started (pid %d)", rank, proc.pid)
        processes.append(proc)
    return WorkerSet(processes)


def serve_batches(group: TensorParallelGroup, handle: Callable[[str, Any], None]) -> None:
    """A worker's loop: run every broadcast (kind, batch) until rank 0 says stop or the
    group breaks (rank 0 gone)."""
    while True:
        try:
            message = group.broadcast(None)
        except (RuntimeError, ConnectionError) as error:
            log.warning("rank %d: control group closed (%s): exiting", group.shard.rank, error)
            return
        if message == STOP or message is None:
            return
        kind, batch = cast("tuple[str, Any]", message)
        try:
            handle(kind, batch)
        except Exception:  # rank 0 reports the same failure to its caller
            log.exception("rank %d: %s failed", group.shard.rank, kind)



def worker_main(options: Any, rank: int, port: int) -> None:
    """Entry point of a spawned worker: build this rank's shard of the runner, then run the
    batches rank 0 broadcasts until it says stop."""
    from common.log import setup_logging
    from gpu_runner.runner import ModelRunner

    setup_logging("gpu_runner")
    runner = ModelRunner(dataclasses.replace(options, tensor_parallel_rank=rank,
                                             tensor_parallel_port=port))
    try:
        runner.serve_worker()
    finally:
        runner.close()
