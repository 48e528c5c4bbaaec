"""`pagewire serve | generate | chat`: run pagewire, or talk to a running one."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

import grpc

from common.log import setup_logging
from common.security import ClientTls
from gateway.client import PagewireClient, finish_reason_name
from gateway.config import ROUTING, add_generation_config_arguments, add_lora_modules_argument
from gateway.launcher import (
    DEFAULT_HTTP_PORT,
    RUNNER_DTYPES,
    SERVICES_NICE,
    LaunchConfig,
    Launcher,
    serving_banner,
)
from protos import gateway_pb2

log = logging.getLogger("pagewire")

DEFAULT_ADDRESS = "127.0.0.1:50051"
DEMO_MESSAGES = [("user", "What is the capital of France?")]


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 2
    handlers = {"serve": serve, "generate": generate, "chat": chat}
    try:
        return handlers[args.command](args)
    except grpc.RpcError as error:
        code = error.code()  # type: ignore[attr-defined]
        print(f"pagewire: {code.name}: {error.details()}", file=sys.stderr)  # type: ignore[attr-defined]
        return 1
    except KeyboardInterrupt:
        return 130


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagewire", description=__doc__)
    commands = parser.add_subparsers(dest="command")
    serve_parser = commands.add_parser(
        "serve", help="start block service, runner and gateway on localhost")
    _add_serve_arguments(serve_parser)
    generate_parser = commands.add_parser(
        "generate", help="stream the answer to a prompt (a chat message when the model has a "
                         "chat template)")
    generate_parser.add_argument("prompt", help="the prompt text")
    generate_parser.add_argument("--raw", action="store_true",
                                 help="complete the prompt as plain text, without the chat "
                                      "template")
    _add_client_arguments(generate_parser)
    chat_parser = commands.add_parser("chat", help="an interactive chat (Ctrl-D ends it)")
    chat_parser.add_argument("--system", default=None, help="a system message")
    _add_client_arguments(chat_parser)
    return parser


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default=None,
                        help="a Hugging Face folder or .gguf file (default: SmolLM2-135M)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=50051, help="the gateway's port")
    parser.add_argument("--http-port", type=int, default=DEFAULT_HTTP_PORT,
                        help="the gateway's OpenAI-compatible HTTP port (gateways: this port "
                             "and the ports after it; 0: no HTTP API)")
    parser.add_argument("--served-model-name", default="",
                        help="the model name of the APIs (default: the model's own)")
    add_generation_config_arguments(parser)
    parser.add_argument("--metrics-port", type=int, default=0,
                        help="the gateway's Prometheus port (0: off)")
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--kv-cache-memory", type=int, default=None,
                        help="bytes of KV cache for the runner")
    parser.add_argument("--max-model-len", type=int, default=None)
    parser.add_argument("--dtype", default=None, choices=RUNNER_DTYPES,
                        help="the weights' and KV cache's dtype in every runner (default: the "
                             "runner's, float32 on CPU and bfloat16 on CUDA)")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None)
    parser.add_argument("--max-num-seqs", type=int, default=None)
    parser.add_argument("--runners", type=_at_least_one, default=1,
                        help="runner processes, each with its own KV cache (on a CPU the cores "
                             "are split between them)")
    parser.add_argument("--gateways", type=_at_least_one, default=1,
                        help="gateway processes, on --port and the ports after it")
    parser.add_argument("--routing", default=None, choices=ROUTING,
                        help="how gateways place requests on runners (default: prefix)")
    add_lora_modules_argument(parser)
    parser.add_argument("--max-loras", type=_at_least_zero, default=None,
                        help="LoRA adapters one batch of a runner may use (its slot table; "
                             "default: 4 with --lora-modules, else 0: no adapters)")
    parser.add_argument("--max-lora-rank", type=_at_least_one, default=None,
                        help="highest LoRA rank the runners accept (default: the runner's, 16)")
    parser.add_argument("--log-dir", type=Path, default=None,
                        help="where the services' logs go (default: a new temp folder)")
    parser.add_argument("--journal-dir", type=Path, default=None,
                        help="the block service's journal, replayed when it restarts "
                             "(default: a folder in --log-dir)")
    parser.add_argument("--no-restart", action="store_true",
                        help="stop everything when a service dies instead of restarting it")
    parser.add_argument("--services-nice", type=int, default=SERVICES_NICE,
                        help="CPU priority the gateway and block service give up (0-19), so "
                             "that on a CPU runner their work gives way to the forward's")
    parser.add_argument("--demo", action="store_true",
                        help="stream the answer to a demo chat prompt once serving")


def _at_least_one(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} is less than 1")
    return value


def _at_least_zero(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is less than 0")
    return value


def _add_client_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default=DEFAULT_ADDRESS, help="the gateway host:port")
    parser.add_argument("--tls-ca", default="", help="PEM CA of the gateway's certificate")
    parser.add_argument("--auth-token-file", default="",
                        help="file whose first line is the bearer token to send")
    parser.add_argument("--max-tokens", type=int, default=None)
    parser.add_argument("--temperature", type=float, default=None)
    parser.add_argument("--top-p", type=float, default=None)
    parser.add_argument("--top-k", type=int, default=None)
    parser.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--seed", type=int, default=None)
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeat)")
    parser.add_argument("-n", type=int, default=None, help="number of outputs")
    parser.add_argument("--usage", action="store_true", help="print token usage at the end")


def _connect(args: argparse.Namespace) -> PagewireClient:
    tls = ClientTls(args.tls_ca) if args.tls_ca else None
    token = None
    if args.auth_token_file:
        token = Path(args.auth_token_file).read_text().splitlines()[0].strip()
    return PagewireClient(args.address, tls=tls, token=token)


def _sampling(args: argparse.Namespace) -> dict[str, Any]:
    params = {
        "max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
        "top_k": args.top_k, "min_p": args.min_p, "seed": args.seed, "n": args.n,
    }
    chosen: dict[str, Any] = {k: v for k, v in params.items() if v is not None}
    if args.stop:
        chosen["stop"] = args.stop
    return chosen


def stream_to(out: TextIO, stream: Any, show_index: bool = False
              ) -> tuple[list[str], gateway_pb2.Usage | None, list[str]]:
    """Prints output 0 as it streams (others are collected); returns texts, usage, reasons."""
    texts: dict[int, str] = {}
    reasons: dict[int, str] = {}
    usage = None
    for message in stream:
        for output in message.outputs:
            texts[output.index] = texts.get(output.index, "") + output.text
            if output.index == 0 and output.text:
                out.write(output.text)
                out.flush()
            if output.finish_reason:
                reasons[output.index] = finish_reason_name(output.finish_reason)
        if message.HasField("usage"):
            usage = message.usage
    out.write("\n")
    ordered = [texts[i] for i in sorted(texts)]
    if show_index:
        for i, text in enumerate(ordered[1:], start=1):
            out.write(f"--- output {i} ---\n{text}\n")
    return ordered, usage, [reasons.get(i, "") for i in sorted(texts)]


def generate(args: argparse.Namespace) -> int:
    with _connect(args) as client:
        if args.raw or not client.model_info().has_chat_template:
            stream = client.generate(args.prompt, **_sampling(args))
        else:
            stream = client.generate(messages=[("user", args.prompt)], **_sampling(args))
        _, usage, reasons = stream_to(sys.stdout, stream, show_index=True)
    if args.usage and usage is not None:
        print(f"[finish: {', '.join(reasons)}; prompt {usage.prompt_tokens} tokens, "
              f"completion {usage.completion_tokens}, cached {usage.cached_tokens}]",
              file=sys.stderr)
    return 0


def chat(args: argparse.Namespace) -> int:
    history: list[tuple[str, str]] = []
    if args.system:
        history.append(("system", args.system))
    interactive = sys.stdin.isatty()
    with _connect(args) as client:
        while True:
            if interactive:
                print("you> ", end="", flush=True)
            line = sys.stdin.readline()
            if not line:
                return 0
            if not line.strip():
                continue
            history.append(("user", line.rstrip("\n")))
            if interactive:
                print("assistant> ", end="", flush=True)
            texts, _, _ = stream_to(sys.stdout, client.generate(
                messages=history, **_sampling(args)))
            history.append(("assistant", texts[0] if texts else ""))


def launch_config(args: argparse.Namespace) -> LaunchConfig:
    """What `pagewire serve` with these arguments starts."""
    return LaunchConfig(
        model=args.model, host=args.host, port=args.port, metrics_port=args.metrics_port,
        http_port=args.http_port, served_model_name=args.served_model_name,
        generation_config=args.generation_config,
        override_generation_config=args.override_generation_config,
        block_size=args.block_size, kv_cache_memory=args.kv_cache_memory,
        max_model_len=args.max_model_len, dtype=args.dtype,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_num_seqs=args.max_num_seqs, runners=args.runners, gateways=args.gateways,
        routing=args.routing, log_dir=args.log_dir, journal_dir=args.journal_dir,
        restart=not args.no_restart, services_nice=args.services_nice,
        lora_modules=list(args.lora_modules), max_loras=args.max_loras,
        max_lora_rank=args.max_lora_rank,
    )


def serve(args: argparse.Namespace) -> int:
    setup_logging("pagewire")
    launcher = Launcher(launch_config(args))
    launcher.install_signal_handlers()
    log.info("logs in %s", launcher.log_dir)
    try:
        launcher.start()
        if args.demo:
            run_demo(launcher.gateway_address)
        with PagewireClient(launcher.gateway_address) as client:
            model = client.model_info().model
        print(serving_banner(launcher.gateway_address, launcher.http_address, model),
              flush=True)
        return launcher.supervise()
    except RuntimeError as error:
        log.error("%s", error)
        return 1
    finally:
        launcher.stop()


def run_demo(address: str) -> None:
    """Streams the answer to the demo prompt to the terminal."""
    print(f"\n>>> {DEMO_MESSAGES[0][1]}\n", flush=True)
    with PagewireClient(address) as client:
        stream_to(sys.stdout, client.generate(messages=DEMO_MESSAGES, temperature=0,
                                              max_tokens=128))
    print(flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
