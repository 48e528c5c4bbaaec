"""The gateway's Prometheus metrics (served on --metrics-port by common.server)."""

from __future__ import annotations

from prometheus_client import Counter, Gauge, Histogram

_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)

PREEMPTIONS = Counter(
    "pagewire_gateway_preemptions", "Sequences preempted (freed, to be recomputed)"
)
STEPS = Counter("pagewire_gateway_steps", "Scheduling steps sent to the block service")
EXECUTES = Counter("pagewire_gateway_executes", "Batches executed by the runner")
SCHEDULED_TOKENS = Counter(
    "pagewire_gateway_scheduled_tokens", "Tokens computed (prefill and decode)"
)
GENERATED_TOKENS = Counter("pagewire_gateway_generated_tokens", "Tokens sampled")
BATCH_SEQS = Histogram(
    "pagewire_gateway_batch_sequences", "Sequences per executed batch", buckets=_SIZE_BUCKETS
)
BATCH_TOKENS = Histogram(
    "pagewire_gateway_batch_tokens", "Tokens per executed batch", buckets=_SIZE_BUCKETS
)
REQUESTS = Counter(
    "pagewire_gateway_requests", "Generate requests by how they ended", ["outcome"]
)
RUNNING = Gauge("pagewire_gateway_running_sequences", "Sequences holding blocks", ["runner"])
WAITING = Gauge("pagewire_gateway_waiting_sequences", "Sequences queued for admission",
                ["runner"])
PLACED_REQUESTS = Counter("pagewire_gateway_placed_requests",
                          "Requests placed on a runner (a moved one again)", ["runner"])
MOVED_REQUESTS = Counter("pagewire_gateway_moved_requests",
                         "Requests moved off a runner that left, to be recomputed elsewhere")
_SECONDS_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5)
STEP_SECONDS = Histogram(
    "pagewire_gateway_block_step_seconds", "Block-service Step round trips",
    buckets=_SECONDS_BUCKETS,
)
EXECUTE_SECONDS = Histogram(
    "pagewire_gateway_execute_seconds", "Runner Execute round trips", buckets=_SECONDS_BUCKETS
)
RUNNER_SECONDS = Histogram(
    "pagewire_gateway_runner_busy_seconds", "Time the runner reports for each batch (total_ms)",
    buckets=_SECONDS_BUCKETS,
)
EXECUTE_WAIT_SECONDS = Histogram(
    "pagewire_gateway_execute_wait_seconds",
    "How long the loop waited for the Execute in flight once the next Step was answered",
    buckets=_SECONDS_BUCKETS,
)
LOOP_SECONDS = Histogram(
    "pagewire_gateway_step_loop_seconds", "Whole scheduling steps (plan to streamed tokens)",
    buckets=_SECONDS_BUCKETS,
)
SCHEDULE_SECONDS = Histogram(
    "pagewire_gateway_schedule_seconds",
    "Planning a step and applying the block service's answer to it", buckets=_SECONDS_BUCKETS,
)
OUTPUT_SECONDS = Histogram(
    "pagewire_gateway_output_seconds",
    "Taking a step's sampled tokens: detokenizing, stop checks, handing deltas to the streams",
    buckets=_SECONDS_BUCKETS,
)
FORWARD_SECONDS = Histogram(
    "pagewire_gateway_runner_forward_seconds", "The model forward of each batch (forward_ms)",
    buckets=_SECONDS_BUCKETS,
)
MASK_SECONDS = Histogram(
    "pagewire_gateway_mask_fill_seconds",
    "Filling a step's token masks (structured output), all its masked rows",
    buckets=_SECONDS_BUCKETS,
)
MASKED_ROWS = Counter(
    "pagewire_gateway_masked_rows_total", "Rows sampled under a structured-output mask")
SAMPLE_SECONDS = Histogram(
    "pagewire_gateway_runner_sample_seconds", "Sampling of each batch (sample_ms)",
    buckets=_SECONDS_BUCKETS,
)
REFUSED_REQUESTS = Counter(
    "pagewire_gateway_refused_requests",
    "Requests refused with a client error before any generation (gateway/refusals.py), by API, "
    "HTTP status or gRPC code, and reason (the field at fault, or a kind such as "
    "unknown_field, model_not_found, unauthorized, limit_reached)",
    ["api", "status", "reason"],
)
