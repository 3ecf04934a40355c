"""Integration tests: one real gateway on the real vLLM engine (default model, eager mode) for the
whole session, started as `python -m gateway serve` and reached over loopback HTTP.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

REPO = Path(__file__).parents[2]
MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 600
# `GATEWAY_TEST_TARGET=vllm` points the conformance suite at vLLM's own OpenAI server instead
# (same model, same engine settings); tests of what only the gateway offers are skipped there.
TARGET = os.environ.get("GATEWAY_TEST_TARGET", "gateway")


def server_command(port: int) -> list[str]:
    if TARGET == "vllm":
        from engine.models import default_model_dir

        return [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(default_model_dir()),
            "--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1", "--enforce-eager",
            "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(2 * 1024**3),
        ]
    return [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--enforce-eager"]


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if TARGET != "vllm":
        return
    for item in items:
        marker = item.get_closest_marker("gateway_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else "a gateway feature that vLLM's server does not have"
            item.add_marker(pytest.mark.skip(reason=f"vLLM's server differs: {reason}"))


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server") / "gateway.log"


@pytest.fixture(scope="session")
def server(server_log: Path) -> Iterator[str]:
    port = free_port()
    log_path = server_log
    env = {**os.environ, "GATEWAY_LOG_FORMAT": "json", "GATEWAY_HEADER_TIMEOUT_S": "3"}
    command = server_command(port)
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_up(base, process, log_path)
        yield base
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()


@contextlib.contextmanager
def gateway_process(folder: Path, env: dict[str, str],
                    tls: ssl.SSLContext | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """Another `python -m gateway serve` on a free port with `env` added, logging to
    folder/gateway.log; up when entered, killed with its engine processes on the way out.
    `tls`: the gateway serves https (env has GATEWAY_TLS__*), reached with this client context."""
    port = free_port()
    log_path = folder / "gateway.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen([sys.executable, "-m", "gateway", "serve", "--port", str(port)],
                                   stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, cwd=REPO)
    base = f"{'https' if tls else 'http'}://127.0.0.1:{port}"
    try:
        wait_until_up(base, process, log_path, verify=tls or True)
        yield base, process
    finally:
        if process.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(process.pid).children(recursive=True):
                    child.kill()
            process.kill()
        process.wait(timeout=30)


def wait_until_up(base: str, process: subprocess.Popen, log_path: Path, verify: ssl.SSLContext | bool = True) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited with {process.returncode}:\n{log_path.read_text()[-5000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"gateway did not start in {START_TIMEOUT_S} s:\n{log_path.read_text()[-5000:]}")


@pytest.fixture(scope="session")
def base_url(server: str) -> str:
    return server


@pytest.fixture
def sdk(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def async_sdk(server: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
