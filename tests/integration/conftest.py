"""Integration tests: one real gateway on the real vLLM engine (default model, eager mode) for the
whole session, started as `python -m gateway serve` and reached over loopback HTTP.

Every gateway here is started on port 0 and read back from its log: once its sockets are bound, the
gateway logs `listening` with the port it got (`gateway.server.http`). No test picks a free port for
the gateway to bind later: another process could take it while the engine starts.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import ssl
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Literal

import httpx
import openai
import psutil
import pytest

from gateway.tenancy.keys import key_id
from tests.adapters import write_adapter
from tests.loopback_server import LoopbackServer
from tests.mcp_servers import SeenHeaders, serving, tool_server
from tests.otlp_receiver import Receiver, receiver
from tests.ports import listening_line
from tests.redis_server import RedisServer

REPO = Path(__file__).parents[2]
MODEL = "smollm2-135m-instruct"
START_TIMEOUT_S = 600
# `GATEWAY_TEST_TARGET=vllm` points the conformance suite at vLLM's own OpenAI server instead
# (same model, same engine settings); tests of what only the gateway offers are skipped there.
TARGET = os.environ.get("GATEWAY_TEST_TARGET", "gateway")
VLLM_ATTEMPTS = 5  # vLLM's server on a port picked here: tried again on another when it was taken
SERVICE_NAME = "gateway-under-test"
Shared = tuple[str, subprocess.Popen, Path]  # a gateway several modules use: base URL, process, log


def gateway_command(*flags: str) -> list[str]:
    """`python -m gateway serve` on any free port (it logs which: `listening_on`)."""
    return [sys.executable, "-m", "gateway", "serve", "--port", "0", *flags]


def vllm_command(port: int) -> list[str]:
    from engine.models import default_model_dir

    return [
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(default_model_dir()),
        "--served-model-name", MODEL, "--port", str(port), "--host", "127.0.0.1", "--enforce-eager",
        "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-memory-bytes", str(2 * 1024**3),
    ]


# A module that shares a gateway with another (`restartable` below) runs right after it (a chain: after
# the module it follows): the shared gateway's engine is then up no longer than one module's own would
# be (engines are memory), and the module that stops it comes last.
FOLLOWS = {"test_guards.py": "test_adapters.py", "test_engine_death.py": "test_guards.py",
           "test_workers.py": "test_backends.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    first: dict[str, int] = {}
    for index, item in enumerate(items):
        first.setdefault(item.path.name, index)

    def place(item: pytest.Item) -> tuple[int, int]:
        name, depth = item.path.name, 0
        while FOLLOWS.get(name) in first:
            name, depth = FOLLOWS[name], depth + 1
        return first[name], depth

    items[:] = sorted(items, key=place)  # (stable: each module's own order stays)
    if TARGET != "vllm":
        return
    for item in items:
        marker = item.get_closest_marker("gateway_only")
        if marker is not None:
            reason = marker.args[0] if marker.args else "a gateway feature that vLLM's server does not have"
            item.add_marker(pytest.mark.skip(reason=f"vLLM's server differs: {reason}"))


def free_port() -> int:
    """A port free now, for vLLM's own server only (it cannot be given port 0 and say which it got):
    another process may take it before vLLM binds it, so `vllm_server` tries again on another."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="session")
def server_log(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("server") / "gateway.log"


@pytest.fixture(scope="session")
def otlp() -> Iterator[tuple[Receiver, int]]:
    """The receiver the session's gateway sends its traces to (test_tracing reads them), and its port."""
    with receiver() as found:
        yield found


@pytest.fixture(scope="session")
def mcp_tools() -> Iterator[tuple[str, SeenHeaders]]:
    """The MCP server the session's gateway knows as `tools` (its servers file allows its loopback address): its
    URL and the headers it saw (test_mcp_responses). Its `weather` takes one of two cities: a small model's forced
    call cannot wander off in a free string until its tokens run out."""
    server = tool_server()

    @server.tool()
    def weather(city: Literal["Paris", "Rome"]) -> str:
        """The weather in a city."""
        return f"{city}: sunny, 21C"

    with serving(server) as found:
        yield found


@pytest.fixture(scope="session")
def server(server_log: Path, otlp: tuple[Receiver, int], mcp_tools: tuple[str, SeenHeaders]) -> Iterator[str]:
    servers = server_log.parent / "mcp-servers.yaml"
    servers.write_text(f"servers:\n  tools: {{url: '{mcp_tools[0]}', allow_private: true}}\n")
    env = {**os.environ, "GATEWAY_LOG_FORMAT": "json", "GATEWAY_HEADER_TIMEOUT_S": "3",
           "GATEWAY_MCP__SERVERS_FILE": str(servers),
           "GATEWAY_TRACING__OTLP_ENDPOINT": f"http://127.0.0.1:{otlp[1]}/v1/traces",
           "GATEWAY_TRACING__SERVICE_NAME": SERVICE_NAME, "GATEWAY_TRACING__ENGINE_SPANS": "true",
           # the batch lane (test_message_batches) in the session's folder, looking for work often
           "GATEWAY_FILES__DIR": str(server_log.parent / "files"), "GATEWAY_BATCHES__DIR": str(server_log.parent / "batches"),
           "GATEWAY_BATCHES__POLL_S": "0.2",
           # a departed client's stream is aborted at once (test_conformance waits for the engine
           # to idle); no test resumes on this gateway, and an orphan generating beside test_resume's
           # comparison answer could change a greedy token through the batch
           "GATEWAY_STREAMS__GRACE_S": "0",
           # a schema's compile on a busy machine is no refusal (test_structured's bound is its own size check)
           "GATEWAY_STRUCTURED_OUTPUT__COMPILE_TIMEOUT_S": "30"}
    starting = vllm_server(server_log, env) if TARGET == "vllm" else session_gateway(server_log, env)
    with starting as base:
        yield base


@contextlib.contextmanager
def session_gateway(log_path: Path, env: dict[str, str]) -> Iterator[str]:
    process = start(gateway_command("--enforce-eager"), env, log_path)
    try:
        scheme, port = listening_on(process, log_path)
        base = f"{scheme}://127.0.0.1:{port}"
        wait_until_up(base, process, log_path)
        yield base
    finally:
        terminate(process)


@contextlib.contextmanager
def vllm_server(log_path: Path, env: dict[str, str]) -> Iterator[str]:
    """vLLM's own server, on a port picked here (vLLM binds it before its engine starts, and does not
    say which port it got when given 0): when it exits because the port was taken, another port."""
    for attempt in range(1, VLLM_ATTEMPTS + 1):
        port = free_port()
        process = start(vllm_command(port), env, log_path)
        base = f"http://127.0.0.1:{port}"
        try:
            try:
                wait_until_up(base, process, log_path)
            except RuntimeError:
                if attempt < VLLM_ATTEMPTS and process.poll() is not None and address_taken(log_path):
                    continue  # (the port was taken before vLLM bound it)
                raise
            yield base
            return
        finally:
            terminate(process)


def address_taken(log_path: Path) -> bool:
    return "address already in use" in log_path.read_text(errors="replace").lower()


def start(command: list[str], env: dict[str, str], log_path: Path) -> subprocess.Popen:
    with open(log_path, "w") as log:
        return subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=REPO)


def terminate(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=30)


@contextlib.contextmanager
def gateway_process(folder: Path, env: dict[str, str], tls: ssl.SSLContext | None = None,
                    flags: tuple[str, ...] = ()) -> Iterator[tuple[str, subprocess.Popen]]:
    """Another `python -m gateway serve` on a free port (port 0: the gateway logs which it got) with
    `env` added, logging to folder/gateway.log; up when entered, killed with its engine processes on
    the way out. `tls`: the gateway serves https (env has GATEWAY_TLS__*), reached with this client context;
    `flags`: more of `gateway serve`'s flags."""
    log_path = folder / "gateway.log"
    process = start(gateway_command(*flags), {**os.environ, **env}, log_path)
    try:
        scheme, port = listening_on(process, log_path)
        assert scheme == ("https" if tls else "http"), f"the gateway listens on {scheme}"
        base = f"{scheme}://127.0.0.1:{port}"
        wait_until_up(base, process, log_path, verify=tls or True)
        yield base, process
    finally:
        if process.poll() is None:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(process.pid).children(recursive=True):
                    child.kill()
            process.kill()
        process.wait(timeout=30)


def listening_on(process: subprocess.Popen, log_path: Path, timeout_s: float = START_TIMEOUT_S) -> tuple[str, int]:
    """The scheme and port a gateway started with `--port 0` got: its `listening` log line (JSON, or
    console), logged once its engines started and its socket is bound. Fails at once, with the log's
    end, when the gateway exits first."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = listening_line(log_path.read_text(errors="replace"))
        if found is not None:
            return found
        if process.poll() is not None:
            raise RuntimeError(f"gateway exited with {process.returncode}:\n{log_path.read_text()[-5000:]}")
        if time.monotonic() >= deadline:
            raise RuntimeError(f"gateway did not listen in {timeout_s} s:\n{log_path.read_text()[-5000:]}")
        time.sleep(0.5)


def wait_until_up(base: str, process: subprocess.Popen, log_path: Path, verify: ssl.SSLContext | bool = True) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}:\n{log_path.read_text()[-5000:]}")
        try:
            if httpx.get(f"{base}/health", timeout=2, verify=verify).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server did not start in {START_TIMEOUT_S} s:\n{log_path.read_text()[-5000:]}")


def in_front_of(server: str, folder: Path) -> dict[str, str]:
    """The env of a gateway whose one model (MODEL) is the session's gateway, reached as a remote
    upstream: for a test about the gateway (TLS, batches, stores, replicas), a gateway that starts in
    seconds without an engine of its own."""
    folder.mkdir(parents=True, exist_ok=True)
    models = folder / "models.yaml"
    models.write_text(f"models:\n  - name: {MODEL}\n    kind: remote\n    url: {server}/v1\n    upstream_model: {MODEL}\n")
    return {"GATEWAY_MODELS_FILE": str(models)}


# One engine with LoRA adapters for three modules: test_adapters (the adapters beside their base, the
# admin API, per-key reach), test_guards (guard profiles: the base as `smol`, two splits of it with
# profiles of their own, a guards file with a moderation upstream) and then test_engine_death (the
# base's engine core killed: liveness fails, its requests go to `rescue`, the session's gateway). One
# engine start instead of three.
LORA_BASE = MODEL
LORA_MODELS = """
models:
  - name: smollm2-135m-instruct
    engine: {{enforce_eager: true, max_loras: 3}}  # room for one loaded by the admin API
    aliases: [smol]
    fallback: [rescue]
  - name: lora-a
    kind: adapter
    base: smollm2-135m-instruct
    path: {a}
    aliases: [la]
  - name: lora-b
    kind: adapter
    base: smollm2-135m-instruct
    path: {b}
  - name: rescue
    kind: remote
    url: {upstream}/v1
    upstream_model: smollm2-135m-instruct
  - name: smol-strict                  # the same engine under a profile of its own
    kind: split
    versions: {{smollm2-135m-instruct: 1}}
    guards: {{input: {{deny: ["(?i)france"]}}}}
  - name: smol-mail                    # its output's emails redacted; the input's let through (an inline
    kind: split                        # profile inherits the default's, whose input redaction would hand the
    versions: {{smollm2-135m-instruct: 1}}  # model a placeholder in the schema's enum, restored as the caller's own)
    guards: {{input: {{pii: {{email: "off"}}}}, output: {{pii: {{email: redact}}}}}}
"""
# test_adapters' and test_engine_death's keys: no guards (their answers are the model's own)
LORA_KEYS = """
keys:
  adapter-only: {key: sk-adapter, models: [lora-a], guards: open}
  base-only: {key: sk-base, models: [smollm2-135m-instruct], guards: open}
  everything: {key: sk-all, guards: open}
"""
# test_guards' keys (GATEWAY_API_KEYS): sk-guarded gets the default profile, sk-open none
GUARDS_TEST_KEYS = ("sk-guarded", "sk-open")
GUARDS = """
default: standard
keys: {OPEN_KEY: open}
moderation: {url: "MODERATION_URL", timeout_s: 5, fail: open}
profiles:
  open: {}
  standard:
    input: {pii: {email: redact, card: block}, injection: block, max_tokens: 400, moderation: block,
            secrets: {aws: redact, github: block}}
    output: {deny: ["Paris"]}
"""
ID_SECRET = "guards-integration-secret"  # key ids (HMAC) the guards file can name


@pytest.fixture(scope="session")
def adapters(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("adapters")
    return {name: write_adapter(folder / name, seed=seed, scale=0.1) for name, seed in (("a", 1), ("b", 2), ("c", 3))}


@pytest.fixture(scope="session")
def moderation() -> Iterator[LoopbackServer]:
    """The LoRA gateway's moderation upstream (test_guards: it flags "kill")."""
    found = LoopbackServer().start()
    yield found
    found.stop()


@pytest.fixture(scope="session")
def lora_gateway(server: str, adapters: dict[str, Path], moderation: LoopbackServer,
                 tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Shared]]:
    """The LoRA gateway (LORA_MODELS, LORA_KEYS, GUARDS): `restartable` (test_engine_death stops it)."""
    folder = tmp_path_factory.mktemp("lora-gateway")
    (folder / "models.yaml").write_text(LORA_MODELS.format(a=adapters["a"], b=adapters["b"], upstream=server))
    (folder / "keys.yaml").write_text(LORA_KEYS)
    (folder / "guards.yaml").write_text(GUARDS.replace("OPEN_KEY", key_id("sk-open", ID_SECRET))
                                        .replace("MODERATION_URL", moderation.url))
    env = {"GATEWAY_MODELS_FILE": str(folder / "models.yaml"), "GATEWAY_KEYS_FILE": str(folder / "keys.yaml"),
           "GATEWAY_API_KEYS": json.dumps(GUARDS_TEST_KEYS), "GATEWAY_GUARDS_FILE": str(folder / "guards.yaml"),
           "GATEWAY_KEY_ID_SECRET": ID_SECRET, "GATEWAY_LOG_PROMPTS": "true",
           "GATEWAY_ADMIN_KEYS": '["sk-admin"]', "GATEWAY_CACHE__BACKEND": "memory", "GATEWAY_LOG_FORMAT": "json"}
    with restartable(folder, env) as running:
        yield running


@pytest.fixture(scope="session")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    """A redis-server for the session: test_backends' gateways share it (a test there stops it and
    starts it again, empty, at the same address)."""
    found = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield found
    found.stop()


@pytest.fixture(scope="session")
def two_workers(redis: RedisServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[[], Shared]]:
    """`--workers 2` on the default model with API keys and the Redis cache on `redis`: another
    replica beside test_backends' second gateway (a Responses conversation continued on it), then
    test_workers' subject (which stops it). One engine start instead of two."""
    folder = tmp_path_factory.mktemp("workers")
    env = {"GATEWAY_API_KEYS": '["sk-integration", "sk-other"]', "GATEWAY_CACHE__BACKEND": "redis",
           "GATEWAY_CACHE__REDIS_URL": redis.url, "GATEWAY_WARMUP": "false", "GATEWAY_LOG_FORMAT": "json",
           "GATEWAY_STRUCTURED_OUTPUT__COMPILE_WORKERS": "0"}
    with restartable(folder, env, "--workers", "2", "--enforce-eager") as running:
        yield running


@contextlib.contextmanager
def restartable(folder: Path, env: dict[str, str], *flags: str) -> Iterator[Callable[[], Shared]]:
    """A `gateway_process` shared by modules, as (base URL, process, log): started on the first call, and again on a call after
    one that found it stopped (a module that stops it comes last in file order, but may not run last)."""
    with contextlib.ExitStack() as started:
        current: list[Shared] = []

        def running() -> Shared:
            if not current or current[-1][1].poll() is not None:
                base, process = started.enter_context(gateway_process(folder, env, flags=flags))
                current.append((base, process, folder / "gateway.log"))
            return current[-1]

        yield running


@pytest.fixture(scope="session")
def base_url(server: str) -> str:
    return server


@pytest.fixture
def sdk(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture
def async_sdk(server: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=300)
