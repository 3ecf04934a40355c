"""Integration tests: one real gateway on the real vLLM engine (default model, eager mode) for the
whole session, started as `python -m gateway serve` and reached over loopback HTTP.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 600


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("server") / "gateway.log"
    env = {**os.environ, "GATEWAY_LOG_FORMAT": "json"}
    command = [sys.executable, "-m", "gateway", "serve", "--port", str(port), "--enforce-eager"]
    with open(log_path, "w") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=Path(__file__).parents[2])
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


def wait_until_up(base: str, process: subprocess.Popen, log_path: Path) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited with {process.returncode}:\n{log_path.read_text()[-5000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2).status_code == 200:
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
