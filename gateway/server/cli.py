"""Command line: `python -m gateway serve [flags]` (or the `llm-gateway` script).

Flags override environment variables; both end up in the one Settings object.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from pydantic import ValidationError

from engine import check_engine_settings
from gateway.app import create_app, tenants_of
from gateway.backends.modelfile import ConfigError
from gateway.pipeline.lifecycle import Lifecycle
from gateway.server.http import DrainingServer, Reloadable, server_config
from gateway.server.tls import ServerTLS
from gateway.settings import Settings
from gateway.telemetry.logs import configure


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
    serve.add_argument("--embedding-model", help="also serve the model as an embedding model under this name")
    serve.add_argument("--keys-file", help="YAML file of API keys with their own settings (GATEWAY_KEYS_FILE)")
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
    tls = serve.add_argument_group("TLS", "HTTPS when a certificate is given (GATEWAY_TLS__*)")
    tls.add_argument("--tls-cert-file", help="PEM certificate chain")
    tls.add_argument("--tls-key-file", help="PEM private key (unset: in the certificate file)")
    tls.add_argument("--tls-ca-file", help="PEM CA certificates to verify client certificates against")
    tls.add_argument("--tls-client-auth", choices=["none", "optional", "required"])
    tls.add_argument("--tls-min-version", choices=["TLSv1.2", "TLSv1.3"])
    return root


TLS_FLAGS = ("cert_file", "key_file", "ca_file", "client_auth", "min_version")
TOP_FLAGS = ("host", "port", "log_level", "log_format", "embedding_model", "keys_file")
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
    top = {k: getattr(args, k) for k in TOP_FLAGS if getattr(args, k) is not None}
    engine = {k: getattr(args, k) for k in ENGINE_FLAGS if getattr(args, k) is not None}
    if args.engine_arg:
        engine["engine_args"] = {**base.engine.engine_args, **dict(args.engine_arg)}
    merged_engine = base.engine.model_copy(update=engine)
    tls = {k: getattr(args, f"tls_{k}") for k in TLS_FLAGS if getattr(args, f"tls_{k}") is not None}
    merged = {"engine": merged_engine.model_dump(), "tls": {**base.tls.model_dump(), **tls}}
    return Settings.model_validate({**base.model_dump(), **top, **merged})


STARTUP_FAILED = 3  # the engines did not start (uvicorn's own status for a failed start-up)


def serve(settings: Settings) -> int:
    configure(settings.log_level, settings.log_format)
    tls = ServerTLS(settings.tls) if settings.tls.enabled else None  # bad files stop us before the engine loads
    lifecycle = Lifecycle()
    tenants = tenants_of(settings)  # a bad keys file stops us here too
    app = create_app(settings, lifecycle=lifecycle, engine_check=check_engine_settings, tenants=tenants)
    config = server_config(app, settings, tls.uvicorn_options() if tls else None)
    reloadables: list[Reloadable] = [tls] if tls else []
    if tenants.enabled:
        reloadables.append(tenants)
    server = DrainingServer(config, lifecycle, settings.drain_timeout_s, reloadables=reloadables)
    server.run()
    return 0 if server.started else STARTUP_FAILED


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    try:
        settings = settings_from(args)
        if args.command == "serve":
            return serve(settings)
    except (ConfigError, ValidationError, ValueError) as exc:  # KeysFileError and TLSConfigError are ValueErrors
        print(f"llm-gateway: configuration error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
