"""ModelRunner: the model and its KV cache, executing validated batches.

execute(batch): validate everything (nothing written on failure) -> block copies -> one
forward over every new token, computing logits only where a sequence samples -> sample.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

import numpy as np
import torch

from common.model_store import model_name, resolve_model
from gpu_runner import cpu_kernels
from gpu_runner.attention.selection import (
    AttentionBackend,
    choose_backend,
    install_backend,
    make_backend,
)
from gpu_runner.batch import BatchLimits, ExecuteBatch, build_inputs, validate_batch
from gpu_runner.config import ModelConfig, load_model_config
from gpu_runner.cuda_graphs import GRAPH_BACKENDS, DecodeGraphs
from gpu_runner.distributed import (
    STOP,
    TensorParallelGroup,
    WorkerLostError,
    WorkerSet,
    build_sharded_model,
    check_tensor_parallel,
    free_port,
    join_group,
    rank_device,
    serve_batches,
    spawn_workers,
    worker_main,
)
from gpu_runner.kv_cache import (
    CacheShape,
    allocate_cache,
    copy_blocks,
    cuda_budget_bytes,
    num_blocks_for_budget,
)
from gpu_runner.layers.linear import (
    GemmPolicy,
    GemmShape,
    install_linear_backend,
    resolve_linear_backend,
)
from gpu_runner.layers.rotary import interleaving_order
from gpu_runner.loader import load_model
from gpu_runner.lora.manager import AdapterManager
from gpu_runner.lora.slots import LoraBatch
from gpu_runner.merging import BatchError
from gpu_runner.models.llama import LlamaForCausalLM
from gpu_runner.sampler import SamplerOutput, TokenMasks, sample, unpack_masks

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30


@dataclass(frozen=True)
class RunnerOptions:
    """How to build a runner (the flags of `python -m gpu_runner`)."""

    model: str | None = None  # folder, .gguf file, or None/"default"
    device: str = "cpu"
    dtype: str | None = None  # None: float32 on CPU, bfloat16 on CUDA
    block_size: int = 16
    kv_cache_memory: int | None = None  # bytes; None: 1 GiB on CPU, utilization on CUDA
    gpu_memory_utilization: float = 0.9
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    num_threads: int | None = None  # CPU threads; None: every core
    attention_backend: str = "auto"  # auto | torch | triton | flash_attn
    linear_backend: str = "auto"  # auto | packed | plain (MKL-packed weights, CPU float32)
    enforce_eager: bool = False  # True: no CUDA graphs
    cuda_graph_max_batch: int = 256  # largest decode batch replayed from a CUDA graph
    tensor_parallel_size: int = 1
    tensor_parallel_rank: int = 0  # set by rank 0 for the workers it spawns
    tensor_parallel_port: int = 0  # the process group's rendezvous port (workers)
    max_loras: int = 0  # LoRA adapters one batch may name (the slot table); 0: none served
    max_lora_rank: int = 16


@dataclass(frozen=True)
class RunnerInfo:
    """What Info reports."""

    model: str
    architecture: str
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    max_model_len: int
    num_blocks: int
    block_size: int
    dtype: str
    device: str
    epoch: int
    attention_backend: str
    tensor_parallel_size: int = 1
    max_loras: int = 0
    max_lora_rank: int = 0


@dataclass(frozen=True)
class ExecuteResult:
    """One entry per sampled sequence, in batch order (numpy on the host)."""

    token_ids: np.ndarray
    logprobs: np.ndarray | None
    top_counts: np.ndarray | None
    top_token_ids: np.ndarray | None  # [sampled, k_max]
    top_logprobs: np.ndarray | None
    forward_ms: float
    sample_ms: float


def new_epoch() -> int:
    """A random non-zero uint64."""
    return secrets.randbits(64) or 1


class ModelRunner:
    """Loads the model, sizes and allocates the cache, executes batches. Not thread-safe:
    the servicer serialises calls."""

    def __init__(self, options: RunnerOptions) -> None:
        self.options = options
        self.rank = options.tensor_parallel_rank
        self.device = rank_device(torch.device(options.device), self.rank)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.dtype = _resolve_dtype(options.dtype, self.device)
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            _log_bf16_kernels()
        if self.device.type == "cpu":
            torch.set_num_threads(options.num_threads or os.cpu_count() or 1)
        self.folder = resolve_model(options.model)
        self.backend_name = choose_backend(options.attention_backend, self.device,
                                           options.block_size)
        self.workers: WorkerSet | None = None
        self.tp = self._join_tensor_parallel()
        self.model, self.config, self.local_config = self._load()
        self.linear_backend, self.linear_policies = self._install_linear_backend()
        self.lora = self._adapter_manager()  # before sizing the cache: its slots take memory
        self.block_size = options.block_size
        self.max_model_len = min(
            options.max_model_len or self.config.max_position_embeddings,
            self.config.max_position_embeddings,
        )
        self.num_blocks = self._size_cache()
        shape = CacheShape(self.config.num_layers, self.num_blocks, self.block_size,
                           self.local_config.num_kv_heads, self.config.head_dim)
        self.kv_cache = allocate_cache(shape, self.dtype, self.device)
        self.limits = BatchLimits(
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            vocab_size=self.config.vocab_size,
            max_model_len=self.max_model_len,
        )
        self.epoch = new_epoch()
        self.graphs = self._capture_graphs()
        # Built (or loaded from its cache) now rather than in the first step.
        cpu_kernel = (self.backend_name == "torch" and cpu_kernels.kernel_dtype(self.dtype)
                      and cpu_kernels.available(self.device))
        log.info("model %s (%s) on %s/%s: %d blocks of %d tokens, max_model_len %d, "
                 "linear backend %s, attention %s%s", self.folder.name,
                 self.config.architecture, self.device, _dtype_name(self.dtype),
                 self.num_blocks, self.block_size, self.max_model_len, self.linear_backend,
                 self.backend_name, " (C++ paged attention kernel)" if cpu_kernel else "")

    # ---- start-up ----

    def _join_tensor_parallel(self) -> TensorParallelGroup | None:
        """With --tensor-parallel-size > 1: rank 0 spawns the workers, then every rank joins
        the process group (before loading, so a shape error is reported before spawning)."""
        size = self.options.tensor_parallel_size
        if size == 1:
            return None
        check_tensor_parallel(load_model_config(self.folder), size)
        port = self.options.tensor_parallel_port
        if self.rank == 0:
            port = free_port()
            worker_options = replace(self.options, model=str(self.folder))
            self.workers = spawn_workers(worker_main, lambda rank: (worker_options, rank, port),
                                         size)
            self.workers.start_monitor()
        return join_group(self.rank, size, port, torch.device(self.options.device))

    def _load(self) -> tuple[LlamaForCausalLM, ModelConfig, ModelConfig]:
        """(model with its attention backend, full config, this rank's shard config)."""
        def backend_for(config: ModelConfig) -> AttentionBackend:
            return make_backend(self.backend_name, config.num_heads, config.num_kv_heads,
                                config.head_dim)

        if self.tp is None:
            loaded = load_model(self.folder, self.device, self.dtype)
            model, config, local = loaded.model, loaded.config, loaded.config
        else:
            model, config, local = build_sharded_model(
                self.folder, self.device, self.dtype, self.tp.shard, self.tp.compute_group,
                backend_for)
        install_backend(model, backend_for(local))
        if self.dtype == torch.float32:
            model.interleave_rotary()  # rotary as one complex multiply (layers/rotary.py)
        return model, config, local

    def _adapter_manager(self) -> AdapterManager | None:
        if self.options.max_loras < 0 or self.options.max_lora_rank < 1:
            raise ValueError("--max-loras must be >= 0 and --max-lora-rank >= 1")
        if not self.options.max_loras:
            return None
        if self.tp is not None:
            raise ValueError("--max-loras does not combine with tensor parallelism yet")
        order = interleaving_order(self.config.head_dim) if self.model.rotary.interleaved \
            else None
        manager = AdapterManager(self.config, self.options.max_loras,
                                 self.options.max_lora_rank, self.dtype, self.device, order)
        log.info("LoRA: %d slots of rank <= %d (%.1f MiB)", manager.max_loras,
                 manager.max_rank, manager.table.nbytes / 2**20)
        return manager

    def _install_linear_backend(self) -> tuple[str, dict[GemmShape, GemmPolicy]]:
        """Packs the projections' weights where that is faster (CPU float32). Not with tensor
        parallelism: its row-parallel layers have their own forward. Returns the backend and
        the policy of each weight shape."""
        requested = self.options.linear_backend
        if self.tp is not None:
            if requested == "packed":
                raise ValueError("--linear-backend packed does not combine with tensor "
                                 "parallelism (use auto or plain)")
            requested = "plain"
        backend = resolve_linear_backend(requested, self.device, self.dtype)
        return backend, install_linear_backend(self.model, backend)

    def _size_cache(self) -> int:
        budget = self.options.kv_cache_memory
        if budget is None:
            if self.device.type == "cuda":
                self._profile_forward()
                budget = cuda_budget_bytes(self.device, self.options.gpu_memory_utilization)
            else:
                budget = DEFAULT_CPU_KV_CACHE_BYTES
        blocks = num_blocks_for_budget(self.local_config, self.block_size, self.dtype, budget,
                                       self.max_model_len)
        # Every rank must address the same blocks: agree on the smallest count.
        return blocks if self.tp is None else self.tp.min_over_ranks(blocks)

    def _capture_graphs(self) -> DecodeGraphs | None:
        if (self.options.enforce_eager or self.device.type != "cuda"
                or self.backend_name not in GRAPH_BACKENDS):
            return None
        graphs = DecodeGraphs(self.model, self.kv_cache, self.block_size, self.max_model_len,
                              self.options.cuda_graph_max_batch)
        graphs.capture()
        return graphs

    def _profile_forward(self) -> None:
        """A forward over one max_model_len prompt, to measure peak activation memory."""
        blocks = -(-self.max_model_len // self.block_size)
        profile_cache = allocate_cache(
            CacheShape(self.config.num_layers, blocks, self.block_size,
                       self.local_config.num_kv_heads, self.config.head_dim),
            self.dtype, self.device)
        length = self.max_model_len
        batch = greedy_prompt_batch(length, self.block_size)
        inputs = build_inputs(batch, self.block_size, self.device)
        with torch.inference_mode():
            self.model(inputs.token_ids, profile_cache, inputs.meta)
        del profile_cache
        torch.cuda.synchronize(self.device)

    def info(self) -> RunnerInfo:
        return RunnerInfo(
            model=model_name(self.folder),
            architecture=self.config.architecture,
            vocab_size=self.config.vocab_size,
            eos_token_ids=self.config.eos_token_ids,
            max_model_len=self.max_model_len,
            num_blocks=self.num_blocks,
            block_size=self.block_size,
            dtype=_dtype_name(self.dtype),
            device=str(self.device),
            epoch=self.epoch,
            attention_backend=self.backend_name,
            tensor_parallel_size=self.options.tensor_parallel_size,
            max_loras=0 if self.lora is None else self.lora.max_loras,
            max_lora_rank=0 if self.lora is None else self.lora.max_rank,
        )

    # ---- tensor-parallel workers (rank 0) ----

    @property
    def failure(self) -> str | None:
        """Why the runner can no longer execute (a worker died), or None."""
        return self.workers.failure if self.workers is not None else None

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Calls callback(reason) when a tensor-parallel worker dies (never with size 1)."""
        if self.workers is not None:
            self.workers.on_failure(callback)

    def _check_workers(self) -> None:
        if self.failure is not None:
            raise WorkerLostError(self.failure)

    def _send_to_workers(self, kind: str, batch: ExecuteBatch) -> None:
        if self.tp is not None and self.rank == 0:
            self.tp.broadcast((kind, batch))

    def serve_worker(self) -> None:
        """A worker's life: run what rank 0 broadcasts until it stops."""
        assert self.tp is not None and self.rank > 0

        def handle(kind: str, batch: ExecuteBatch) -> None:
            if kind == "execute":
                self._execute_local(batch)
            else:
                self._forward_logits_local(batch)

        serve_batches(self.tp, handle)

    def close(self) -> None:
        """Stops the workers (rank 0) and leaves the process group."""
        if self.tp is None:
            return
        if self.rank == 0 and self.workers is not None:
            self.workers.stopping = True
            if self.workers.failure is None:
                try:
                    self.tp.broadcast(STOP)
                except RuntimeError as error:
                    log.warning("could not tell the workers to stop: %s", error)
            self.workers.stop()
        self.tp.close()
        self.tp = None

    # ---- batches ----

    def execute(self, batch: ExecuteBatch,
                late_masks: Callable[[], bytes] | None = None) -> ExecuteResult:
        """Validates (BatchError, cache untouched), copies, runs the forward, samples.
        With tensor parallelism the workers run the same forward on their shards.
        `late_masks` gives a masks_follow batch's masks once the forward is done."""
        self._check_workers()
        self.validate(batch)
        self._send_to_workers("execute", batch)
        return self._execute_local(batch, late_masks)

    def validate(self, batch: ExecuteBatch) -> None:
        """BatchError when the batch is malformed or names adapters it cannot run."""
        validate_batch(batch, self.limits)
        self.check_adapters(batch)

    def check_adapters(self, batch: ExecuteBatch) -> None:
        """BatchError when the batch names adapters this runner cannot run."""
        if any(batch.adapters):
            if self.lora is None:
                raise BatchError("the batch names LoRA adapters; this runner serves none "
                                 "(start it with --max-loras)")
            self.lora.check(batch.adapters)

    def _execute_local(self, batch: ExecuteBatch,
                       late_masks: Callable[[], bytes] | None = None) -> ExecuteResult:
        start = time.perf_counter()
        inputs = build_inputs(batch, self.block_size, self.device)
        lora = self._lora_batch(batch)
        with torch.inference_mode():
            copy_blocks(self.kv_cache, inputs.copy_src, inputs.copy_dst)
            if lora is None and self.graphs is not None and self.graphs.can_run(batch):
                logits = self.graphs.run(batch)
            else:
                logits = self.model(inputs.token_ids, self.kv_cache, inputs.meta, lora)
            forward_done = time.perf_counter()
            output = None
            if inputs.sampling is not None:
                inputs.sampling.masks = self._token_masks(batch, late_masks)
                output = sample(logits, inputs.sampling)
        sample_done = time.perf_counter()
        counts = inputs.sampling.num_logprobs if inputs.sampling is not None else None
        return _result(output, counts, forward_done - start, sample_done - forward_done)

    def _token_masks(self, batch: ExecuteBatch, late_masks: Callable[[], bytes] | None
                     ) -> TokenMasks | None:
        """The batch's masks (structured output) as rows of its sampled rows. A worker of a
        tensor-parallel group has no late masks: its samples are not used."""
        if not batch.mask_seq_indices.size:
            return None
        if batch.masks_follow:
            if late_masks is None:
                return None
            data = late_masks()
        else:
            data = batch.masks
        sampled_row = np.cumsum(batch.do_sample) - 1
        rows = sampled_row[batch.mask_seq_indices]
        return TokenMasks(torch.from_numpy(rows).to(self.device),
                          unpack_masks(data, rows.shape[0], self.limits.vocab_size, self.device))

    def forward_logits(self, batch: ExecuteBatch) -> torch.Tensor:
        """Like execute but returns the logits of the sampling positions (tests, debugging)."""
        self._check_workers()
        self.validate(batch)
        self._send_to_workers("logits", batch)
        return self._forward_logits_local(batch)

    def _forward_logits_local(self, batch: ExecuteBatch) -> torch.Tensor:
        inputs = build_inputs(batch, self.block_size, self.device)
        lora = self._lora_batch(batch)
        with torch.inference_mode():
            copy_blocks(self.kv_cache, inputs.copy_src, inputs.copy_dst)
            return self.model(inputs.token_ids, self.kv_cache, inputs.meta, lora)

    def _lora_batch(self, batch: ExecuteBatch) -> LoraBatch | None:
        if self.lora is None or not any(batch.adapters):
            return None
        return self.lora.for_batch(batch.adapters, batch.num_new_tokens)


def _result(
    output: SamplerOutput | None,
    num_logprobs: torch.Tensor | None,
    forward_s: float,
    sample_s: float,
) -> ExecuteResult:
    if output is None:
        empty = np.zeros(0, dtype=np.int64)
        return ExecuteResult(empty, None, None, None, None, forward_s * 1e3, sample_s * 1e3)
    logprobs = top_ids = top_logprobs = top_counts = None
    if output.logprobs is not None:
        logprobs = output.logprobs.cpu().numpy()
    if output.top_token_ids is not None and output.top_logprobs is not None:
        top_ids = output.top_token_ids.cpu().numpy()
        top_logprobs = output.top_logprobs.cpu().numpy()
    if num_logprobs is not None:
        top_counts = num_logprobs.cpu().numpy()
    return ExecuteResult(
        token_ids=output.token_ids.cpu().numpy(),
        logprobs=logprobs,
        top_counts=top_counts,
        top_token_ids=top_ids,
        top_logprobs=top_logprobs,
        forward_ms=forward_s * 1e3,
        sample_ms=sample_s * 1e3,
    )


def greedy_prompt_batch(length: int, block_size: int) -> ExecuteBatch:
    """One prompt of `length` zeros in blocks 0.. (profiling and benchmarks)."""
    blocks = -(-length // block_size)
    return ExecuteBatch(
        num_new_tokens=np.array([length]),
        start_positions=np.array([0]),
        token_ids=np.zeros(length, dtype=np.int64),
        slot_mapping=np.arange(length, dtype=np.int64),
        block_table_lens=np.array([blocks]),
        block_tables=np.arange(blocks, dtype=np.int64),
        do_sample=np.array([True]),
        temperatures=np.zeros(1, dtype=np.float32),
        top_ps=np.ones(1, dtype=np.float32),
        top_ks=np.zeros(1, dtype=np.int64),
        min_ps=np.zeros(1, dtype=np.float32),
        seeds=np.zeros(1, dtype=np.uint64),
    )


def _log_bf16_kernels() -> None:
    """One line when a bfloat16 runner cannot use the fast kernels (cpu_kernels.bf16_native)."""
    why = cpu_kernels.bf16_fallback_reason()
    if why is not None:
        log.warning("bfloat16 fallback: %s; --dtype bfloat16 runs on plain torch kernels "
                    "(correct, slower)", why)


def _resolve_dtype(name: str | None, device: torch.device) -> torch.dtype:
    if name is None:
        # bfloat16 attention is several times slower on CPUs: keep float32 there.
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype {name!r} is not supported ({', '.join(DTYPES)})")
    return DTYPES[name]


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
