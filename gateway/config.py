"""The gateway's settings and the command-line flags that set them."""

from __future__ import annotations

import argparse
import os
import secrets
from dataclasses import dataclass, field
from typing import Any

from common.security import read_tokens
from gateway.sampling_defaults import FROM_MODEL, OPENAI_DEFAULTS, parse_override
from gateway.validation import (
    MAX_PROMPT_TOKENS,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_STRINGS,
    MAX_STREAM_INTERVAL,
    MAX_TOKENS_LIMIT,
)

DEFAULT_GATEWAY_PORT = 50051
# Routing policies (block.proto RoutingPolicy; docs/scaling.md).
ROUTING = ("prefix", "least-loaded", "round-robin")
# A Generate stream holds a server thread for its whole life, so the gateway needs many more
# workers than the unary services.
DEFAULT_MAX_WORKERS = 256
# Streams allowed at once: below DEFAULT_MAX_WORKERS so that unary calls (Tokenize, health)
# still find a thread when every stream slot is taken.
DEFAULT_MAX_STREAMS = 224
DEFAULT_MAX_STREAMS_PER_CLIENT = 64
# HTTP requests open at once. They hold no thread (the HTTP API runs on one asyncio loop), so
# the bound is the engine's queue, not a thread pool: a benchmark client or a proxy sends
# hundreds at once from one address. Per client it is off by default, since behind a proxy
# every client has the proxy's address.
DEFAULT_MAX_HTTP_STREAMS = 1024
# The public API takes requests of at most 4 MiB (the internal services keep common.server's
# 64 MiB): a prompt at --max-prompt-tokens fits many times over, and a hostile client cannot
# make the gateway parse and hold tens of MiB per call.
DEFAULT_MAX_MESSAGE_BYTES = 4 * 1024 * 1024


@dataclass
class GatewayConfig:
    """What the gateway connects to and how it schedules."""

    block_service: str = "127.0.0.1:50052"
    # The OpenAI-compatible HTTP API (gateway/http/) on this port of --host; 0: not served.
    http_port: int = 0
    served_model_name: str = ""  # the model name of the APIs ("": the runner's)
    # Where default sampling parameters come from (gateway/sampling_defaults.py): "auto" (the
    # model's generation_config.json), "openai" (none) or a folder; and the operator's JSON
    # override of generation-config fields.
    generation_config: str = FROM_MODEL
    override_generation_config: dict[str, Any] = field(default_factory=dict)
    # The runners to serve (--runner); empty: every runner registered with the block service.
    runners: list[str] = field(default_factory=list)
    routing: str = "prefix"  # how a request's runner is chosen (see ROUTING)
    model: str | None = None  # model spec for the tokenizer (None: the default model)
    max_num_batched_tokens: int = 1024
    max_num_seqs: int = 64
    max_waiting: int = 1024
    stream_interval: int = 1  # tokens per message when a request does not say
    max_n: int = 16
    # Limits on what one client may ask (each refusal names its flag).
    max_prompt_tokens: int = MAX_PROMPT_TOKENS
    max_tokens_limit: int = MAX_TOKENS_LIMIT
    max_stop_strings: int = MAX_STOP_STRINGS
    max_stop_string_chars: int = MAX_STOP_STRING_CHARS
    max_streams: int = DEFAULT_MAX_STREAMS
    max_streams_per_client: int = DEFAULT_MAX_STREAMS_PER_CLIENT
    max_http_streams: int = DEFAULT_MAX_HTTP_STREAMS
    max_http_streams_per_client: int = DEFAULT_MAX_HTTP_STREAMS
    lease_ttl_ms: int = 10_000
    pool_id: str = ""  # empty: the runner's address (only with one --runner)
    # Names this gateway in the block service (sessions, routes): unique per process.
    client_name: str = field(default_factory=lambda: f"gateway/{secrets.token_hex(4)}")
    rpc_timeout_s: float = 120.0
    # How the gateway reaches the block service and the runner when they serve TLS / tokens.
    backend_tls_ca: str = ""  # CA of their certificates: TLS on when set
    backend_tls_cert: str = ""  # the gateway's certificate, for mutual TLS
    backend_tls_key: str = ""
    backend_token: str = ""  # bearer token sent to them
    # LoRA adapters (name, path on the runners) loaded at start, before serving.
    lora_modules: list[tuple[str, str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens < 1:
            raise ValueError("--max-num-batched-tokens must be >= 1")
        if self.max_num_seqs < 1:
            raise ValueError("--max-num-seqs must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            # Every running sequence's decode token must fit in one step: with a smaller budget
            # the scheduler's admission-order pass would starve the later decodes.
            raise ValueError(
                f"--max-num-batched-tokens ({self.max_num_batched_tokens}) must be >= "
                f"--max-num-seqs ({self.max_num_seqs})")
        if self.max_waiting < 1:
            raise ValueError("--max-waiting must be >= 1")
        if self.max_n < 1:
            raise ValueError("--max-n must be >= 1")
        for flag, value in (("--max-prompt-tokens", self.max_prompt_tokens),
                            ("--max-tokens-limit", self.max_tokens_limit),
                            ("--max-stop-string-chars", self.max_stop_string_chars),
                            ("--max-streams", self.max_streams),
                            ("--max-streams-per-client", self.max_streams_per_client),
                            ("--max-http-streams", self.max_http_streams),
                            ("--max-http-streams-per-client",
                             self.max_http_streams_per_client)):
            if value < 1:
                raise ValueError(f"{flag} must be >= 1")
        if self.max_stop_strings < 0:
            raise ValueError("--max-stop-strings must be >= 0")
        if not 1 <= self.stream_interval <= MAX_STREAM_INTERVAL:
            raise ValueError(f"--stream-interval must be in [1, {MAX_STREAM_INTERVAL}]")
        if self.routing not in ROUTING:
            raise ValueError(f"--routing {self.routing!r}: expected one of {', '.join(ROUTING)}")
        if not 0 <= self.http_port <= 65535:
            raise ValueError(f"--http-port {self.http_port}: give 1-65535, or 0 for none")
        if self.pool_id and len(self.runners) != 1:
            raise ValueError("--pool-id names the pool of a single --runner")

    def pool_id_of(self, runner: str) -> str:
        """The pool name of a --runner runner."""
        return self.pool_id or runner


def add_gateway_arguments(parser: argparse.ArgumentParser) -> None:
    """Adds the gateway's own flags (the server flags come from common.server)."""
    defaults = GatewayConfig()
    parser.add_argument("--block-service", default=defaults.block_service,
                        help="block service address host:port")
    parser.add_argument("--http-port", type=int, default=defaults.http_port,
                        help="serve the OpenAI-compatible HTTP API on this port of --host "
                             "(0: not served; docs/api.md)")
    parser.add_argument("--served-model-name", default="",
                        help="the model name of the APIs (default: the model's own)")
    add_generation_config_arguments(parser)
    parser.add_argument("--runner", action="append", default=[], dest="runners",
                        help="a runner to serve, host:port (repeat for several); without it, "
                             "every runner registered with the block service")
    parser.add_argument("--routing", default=defaults.routing, choices=ROUTING,
                        help="how a request's runner is chosen: prefix (cached prefix and "
                             "load), least-loaded, round-robin (docs/scaling.md)")
    parser.add_argument("--model", default=None,
                        help="model spec for the tokenizer: a folder, a .gguf file or 'default'")
    parser.add_argument("--max-num-batched-tokens", type=int,
                        default=defaults.max_num_batched_tokens,
                        help="tokens computed per scheduling step (decodes + prefill chunks)")
    parser.add_argument("--max-num-seqs", type=int, default=defaults.max_num_seqs,
                        help="sequences running at once")
    parser.add_argument("--max-waiting", type=int, default=defaults.max_waiting,
                        help="requests queued before RESOURCE_EXHAUSTED")
    parser.add_argument("--stream-interval", type=int, default=defaults.stream_interval,
                        help="tokens per streamed message when a request does not set "
                             "stream_interval: the first at once, then every N (larger N "
                             "costs less CPU per token; a slow reader gets fewer, larger "
                             "messages anyway)")
    parser.add_argument("--max-n", type=int, default=defaults.max_n, help="largest n per request")
    parser.add_argument("--max-prompt-tokens", type=int, default=defaults.max_prompt_tokens,
                        help="longest prompt in tokens")
    parser.add_argument("--max-tokens-limit", type=int, default=defaults.max_tokens_limit,
                        help="largest max_tokens a request may ask for (and the default cap)")
    parser.add_argument("--max-stop-strings", type=int, default=defaults.max_stop_strings,
                        help="most stop strings per request")
    parser.add_argument("--max-stop-string-chars", type=int,
                        default=defaults.max_stop_string_chars,
                        help="longest stop string in characters")
    parser.add_argument("--max-streams", type=int, default=defaults.max_streams,
                        help="Generate streams open at once, all clients together "
                             "(keep below --max-workers)")
    parser.add_argument("--max-streams-per-client", type=int,
                        default=defaults.max_streams_per_client,
                        help="Generate streams open at once per client (bearer token, else "
                             "peer address)")
    parser.add_argument("--max-http-streams", type=int, default=defaults.max_http_streams,
                        help="HTTP API requests open at once (they hold no thread; the waiting "
                             "queue, --max-waiting, bounds them too)")
    parser.add_argument("--max-http-streams-per-client", type=int,
                        default=defaults.max_http_streams_per_client,
                        help="HTTP API requests open at once per client (bearer token, else "
                             "address; default: --max-http-streams' default, i.e. off)")
    parser.add_argument("--lease-ttl-ms", type=int, default=defaults.lease_ttl_ms,
                        help="block-service session lease asked for")
    parser.add_argument("--pool-id", default="",
                        help="KV pool name of the one --runner in the block service (default: "
                             "its address)")
    parser.add_argument("--backend-tls-ca", default="",
                        help="PEM CA of the backends' certificates: connect over TLS")
    parser.add_argument("--backend-tls-cert", default="",
                        help="PEM client certificate for mutual TLS with the backends")
    parser.add_argument("--backend-tls-key", default="", help="its PEM private key")
    parser.add_argument("--backend-auth-token-file", default="",
                        help="token file (as --auth-token-file) whose first token is sent to "
                             "the backends")
    add_lora_modules_argument(parser)
    if "PAGEWIRE_GATEWAY_MAX_WORKERS" not in os.environ:
        parser.set_defaults(max_workers=DEFAULT_MAX_WORKERS)
    if "PAGEWIRE_GATEWAY_MAX_MESSAGE_BYTES" not in os.environ:
        parser.set_defaults(max_message_bytes=DEFAULT_MAX_MESSAGE_BYTES)


def add_lora_modules_argument(parser: argparse.ArgumentParser) -> None:
    """--lora-modules (the gateway's and `pagewire serve`'s)."""
    parser.add_argument("--lora-modules", nargs="+", default=[], type=lora_module,
                        metavar="NAME=PATH",
                        help="LoRA adapters to serve from the start, each as name=path (a "
                             "folder of PEFT's adapter_config.json and "
                             "adapter_model.safetensors on the runners); requests name them "
                             "in `model`. The runners need --max-loras > 0")


def lora_module(text: str) -> tuple[str, str]:
    """A --lora-modules item: name=path."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r}: give name=path")
    return name, path


def add_generation_config_arguments(parser: argparse.ArgumentParser) -> None:
    """--generation-config and --override-generation-config (the gateway's and `pagewire
    serve`'s)."""
    parser.add_argument("--generation-config", default=FROM_MODEL,
                        help=f"default sampling parameters: {FROM_MODEL} (the model's "
                             f"generation_config.json), {OPENAI_DEFAULTS} (OpenAI's defaults "
                             "only; vllm is taken as its vLLM name) or a folder holding a "
                             "generation_config.json; a request's own parameters always win "
                             "(docs/api.md)")
    parser.add_argument("--override-generation-config", default="", type=_override,
                        help='JSON of generation-config fields over those defaults, e.g. '
                             '\'{"temperature": 0.5, "max_new_tokens": 512}\' (null drops one)')


def _override(text: str) -> dict[str, Any]:
    try:
        return parse_override(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def config_from_args(args: argparse.Namespace) -> GatewayConfig:
    """Reads the flags added by add_gateway_arguments."""
    return GatewayConfig(
        block_service=args.block_service,
        http_port=args.http_port,
        served_model_name=args.served_model_name,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        runners=args.runners,
        routing=args.routing,
        model=args.model,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs,
        max_waiting=args.max_waiting,
        stream_interval=args.stream_interval,
        max_n=args.max_n,
        max_prompt_tokens=args.max_prompt_tokens,
        max_tokens_limit=args.max_tokens_limit,
        max_stop_strings=args.max_stop_strings,
        max_stop_string_chars=args.max_stop_string_chars,
        max_streams=args.max_streams,
        max_streams_per_client=args.max_streams_per_client,
        max_http_streams=args.max_http_streams,
        max_http_streams_per_client=args.max_http_streams_per_client,
        lease_ttl_ms=args.lease_ttl_ms,
        pool_id=args.pool_id,
        client_name=f"gateway@{args.host}:{args.port}/{secrets.token_hex(4)}",
        backend_tls_ca=args.backend_tls_ca,
        backend_tls_cert=args.backend_tls_cert,
        backend_tls_key=args.backend_tls_key,
        backend_token=_first_token(args.backend_auth_token_file),
        lora_modules=list(args.lora_modules),
    )


def _first_token(path: str) -> str:
    """The first token of a token file, read by the same rules as the servers' (blank lines
    and # comments skipped), so one file can serve both ends."""
    return read_tokens(path)[0] if path else ""
