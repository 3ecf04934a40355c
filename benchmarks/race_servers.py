"""The race's servers as commands: the gateway on the real engine, vLLM's own OpenAI server, the
gateway on the echo engine (its production settings: access log, metrics, an API key, request ids,
the memory response cache) and the bare Starlette endpoint; plus the engine alone's settings. The
same model and engine settings for every engine (`engine_settings`)."""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks.procs import REPO
from benchmarks.race_report import SERVED_NAME

BENCH_KEY = "sk-race-bench"  # the echo gateway's API key: auth is on there, as in production


def python_m(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def prepare_model() -> str:
    subprocess.run(python_m("engine.models", "prepare"), cwd=REPO, check=True, stdout=sys.stderr)
    out = subprocess.run(python_m("engine.models", "path"), cwd=REPO, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def gateway_command(args: argparse.Namespace, port: int, eager: bool) -> list[str]:
    command = python_m(
        "gateway", "serve", "--host", "127.0.0.1", "--port", str(port), "--model", args.model,
        "--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
    )
    return command + (["--enforce-eager"] if eager else [])


# Our access line per request off (vLLM's server logs no requests either); vLLM's own logging as
# in vLLM's server (INFO, text), not following our level.
GATEWAY_ENV = {
    "GATEWAY_WARMUP": "false", "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_LOG_LEVEL": "warning",
    "GATEWAY_ENGINE__LOG_LEVEL": "info", "GATEWAY_ENGINE__LOG_FORMAT": "text",
}


def _vllm_source(*parts: str) -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    try:
        return path.read_text()
    except OSError:
        return ""


def vllm_quiet_flags() -> list[str]:
    """Request logs and uvicorn's access log off, by the flag names this vLLM has (read from its
    source, so no 15-second `--help`): `--disable-log-requests` went away when request logging
    became opt-in (`--enable-log-requests`)."""
    args_src = _vllm_source("engine", "arg_utils.py")
    flags = []
    if '"--enable-log-requests"' in args_src:
        flags.append("--no-enable-log-requests")
    elif '"--disable-log-requests"' in args_src:
        flags.append("--disable-log-requests")
    cli_src = "".join(
        _vllm_source(*p) for p in (("entrypoints", "openai", "cli_args.py"), ("entrypoints", "launchers", "cli_args.py"))
    )
    if "disable_uvicorn_access_log" in cli_src or "disable-uvicorn-access-log" in cli_src:
        flags.append("--disable-uvicorn-access-log")
    if "uvicorn_log_level" in cli_src or "uvicorn-log-level" in cli_src:
        flags += ["--uvicorn-log-level", "warning"]
    return flags


def vllm_command(args: argparse.Namespace, port: int, eager: bool) -> list[str]:
    command = python_m(
        "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port), "--model", args.model,
        "--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes), "--seed", "0",
    )
    return command + (["--enforce-eager"] if eager else []) + vllm_quiet_flags()



# The gateway on the echo engine as deployed: access lines (info, JSON, to its log file), metrics
# (always on), auth with an API key, request ids (always on), the memory response cache (the default).
ECHO_ENV = {
    "GATEWAY_WARMUP": "false", "GATEWAY_LOG_LEVEL": "info", "GATEWAY_LOG_FORMAT": "json",
    "GATEWAY_API_KEYS": json.dumps([BENCH_KEY]), "GATEWAY_CACHE__BACKEND": "memory",
}


def echo_command(port: int) -> list[str]:
    return python_m("benchmarks.echo_engine", "--port", str(port), "--name", SERVED_NAME)


def bare_command(port: int) -> list[str]:
    return python_m("benchmarks.bare_app", "--port", str(port), "--name", SERVED_NAME)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine alone's settings: the servers' (see gateway_command and vllm_command)."""
    return {
        "model": args.model, "served_model_name": SERVED_NAME, "dtype": args.dtype,
        "max_model_len": args.max_model_len, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "enforce_eager": args.eager, "seed": 0,
    }
