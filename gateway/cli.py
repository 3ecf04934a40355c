"""Command line: `python -m gateway serve [flags]` (or the `llm-gateway` script).

Flags override environment variables; both end up in the one Settings object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import ValidationError

from gateway.app import create_app
from gateway.backends.modelfile import ConfigError
from gateway.logs import configure
from gateway.middleware.lifecycle import Lifecycle
from gateway.server import DrainingServer, server_config
from gateway.settings import Settings


def _engine_arg(text: str) -> tuple[str, Any]:
    key, sep, value = text.partition("=")
    if not sep:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(prog="llm-gateway", description="OpenAI-compatible LLM gateway")
    commands = root.add_subparsers(dest="command", required=True)
    serve = commands.add_parser("serve", help="start the gateway")
    serve.add_argument("--host")
    serve.add_argument("--port", type=int)
    serve.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    serve.add_argument("--log-format", choices=["console", "json"])
    serve.add_argument("--model", help="model directory or hub id (default: the prepared SmolLM2)")
    serve.add_argument("--served-model-name")
    serve.add_argument("--max-model-len", type=int)
    serve.add_argument("--dtype")
    serve.add_argument("--gpu-memory-utilization", type=float)
    serve.add_argument("--kv-cache-memory-bytes", type=int)
    serve.add_argument("--enforce-eager", action=argparse.BooleanOptionalAction, default=None)
    serve.add_argument("--tensor-parallel-size", type=int)
    serve.add_argument("--max-num-seqs", type=int)
    serve.add_argument(
        "--engine-arg",
        type=_engine_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other vLLM engine argument (value parsed as JSON when it can be)",
    )
    return root


ENGINE_FLAGS = (
    "model",
    "served_model_name",
    "max_model_len",
    "dtype",
    "gpu_memory_utilization",
    "kv_cache_memory_bytes",
    "enforce_eager",
    "tensor_parallel_size",
    "max_num_seqs",
)


def settings_from(args: argparse.Namespace) -> Settings:
    """Environment first, flags on top (only the flags given)."""
    base = Settings()
    top = {k: getattr(args, k) for k in ("host", "port", "log_level", "log_format") if getattr(args, k) is not None}
    engine = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if args.engine_arg:
        engine["engine_args"] = {**base.engine.engine_args, **dict(args.engine_arg)}
    merged_engine = base.engine.model_copy(update=engine)
    return Settings.model_validate({**base.model_dump(), **top, "engine": merged_engine.model_dump()})


def serve(settings: Settings) -> None:
    configure(settings.log_level, settings.log_format)
    lifecycle = Lifecycle()
    app = create_app(settings, lifecycle=lifecycle)
    DrainingServer(server_config(app, settings), lifecycle, settings.drain_timeout_s).run()


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = settings_from(args)
        if args.command == "serve":
            serve(settings)
    except (ConfigError, ValidationError, ValueError) as exc:
        print(f"llm-gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
