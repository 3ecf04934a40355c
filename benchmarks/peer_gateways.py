"""The peer gateways of the race's `peers` part (`benchmarks.peers`): what each one is, how it is
installed (each in a folder of its own under a cache directory, never in the project's venv), the
configuration that routes one model to the instant endpoint, the command that starts it, and how a
request reaches it (base URL, model name, headers). Every peer runs with its defaults but for what
routing to the upstream needs; their logging stays at its default level.

    LiteLLM proxy     pip `litellm[proxy]`, a YAML model list, a master key (its proxy wants one)
    Portkey gateway   npm `@portkey-ai/gateway`, no config: the upstream comes in headers
    TensorZero        pip `tensorzero`: its HTTP gateway runs inside a Python process (the package's
                      `_start_http_gateway`, the one `patch_openai_client` uses), a TOML config
    SGLang Model GW   pip `smg`: `smg launch --backend openai --worker-urls <upstream>`

Installing is a plain subprocess (pip into a venv, npm into a folder), once per version: a stamp
file says it is done. Nothing here measures anything.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

MODEL = "bare"  # the instant endpoint's model name, routed to by every peer
CACHE = Path.home() / ".cache" / "llm-gateway" / "peers"
LITELLM_KEY = "sk-bench"  # LiteLLM's proxy refuses to start its auth without a master key
INSTALL_TIMEOUT_S = 1800

# The versions installed by default (`--pin NAME=VERSION` picks another); checked on this machine.
PINS = {"litellm": "1.108.7", "portkey": "1.15.2", "tensorzero": "2026.6.0", "smg": "1.13.0"}
# Portkey 1.15's streams fail ("TypeError: immutable") with newer @hono/node-server: held back
PORTKEY_OVERRIDES = {"@hono/node-server": "1.13.5"}


@dataclasses.dataclass(frozen=True)
class Route:
    """How the load generator reaches a gateway: base URL path, model name, headers, API key."""

    path: str = "/v1"
    model: str = MODEL
    headers: dict[str, str] = dataclasses.field(default_factory=dict)
    api_key: str | None = None


@dataclasses.dataclass(frozen=True)
class Launch:
    """A started peer's command, environment and the files written for it."""

    command: list[str]
    env: dict[str, str]
    route: Route
    port_from_log: bool = False  # the peer picks its port and prints it (TensorZero's embedded server)


@dataclasses.dataclass(frozen=True)
class Peer:
    name: str
    title: str  # for the table, e.g. "LiteLLM proxy (Python)"
    package: str  # what is installed (pip spec or npm name) without the version
    kind: str  # "pip" or "npm"
    launch: Callable[[Path, str, int, Path], Launch]  # (install dir, upstream /v1 URL, port, config dir)

    def spec(self, version: str) -> str:
        return f"{self.package}=={version}" if self.kind == "pip" else f"{self.package}@{version}"


# ----------------------------------------------------------------------------------------------
# Configuration files (pure: tested in tests/tooling/test_peers.py)


def litellm_config(upstream: str) -> str:
    """LiteLLM's proxy config: one model `bare` served by an OpenAI-compatible upstream."""
    return (
        "model_list:\n"
        f"  - model_name: {MODEL}\n"
        "    litellm_params:\n"
        f"      model: openai/{MODEL}\n"
        f"      api_base: {json.dumps(upstream)}\n"
        "      api_key: none\n"
        "general_settings:\n"
        f"  master_key: {LITELLM_KEY}\n"
    )


def tensorzero_config(upstream: str) -> str:
    """TensorZero's config: model `bare` with one OpenAI provider at the upstream, no API key."""
    base = upstream.rstrip("/") + "/"
    return (
        f"[models.{MODEL}]\n"
        'routing = ["mock"]\n\n'
        f"[models.{MODEL}.providers.mock]\n"
        'type = "openai"\n'
        f'model_name = "{MODEL}"\n'
        f"api_base = {json.dumps(base)}\n"
        'api_key_location = "none"\n'
    )


TENSORZERO_LAUNCHER = '''"""TensorZero's HTTP gateway inside this process (the Python package's embedded server)."""
import sys
import time

import tensorzero

gateway = tensorzero._start_http_gateway(config_file=sys.argv[1], clickhouse_url=None, postgres_url=None,
                                         valkey_url=None, async_setup=False)
print("BASE_URL", gateway.base_url, flush=True)
while True:
    time.sleep(3600)
'''


def tensorzero_port(log_text: str) -> int | None:
    """The port TensorZero's embedded gateway chose, from the launcher's `BASE_URL http://host:port/...` line."""
    found = re.search(r"^BASE_URL https?://[^/:]+:(\d+)/", log_text, re.MULTILINE)
    return int(found.group(1)) if found else None


def portkey_package(version: str) -> str:
    """The package.json of Portkey's install folder: the gateway pinned, @hono/node-server held back."""
    return json.dumps({"private": True, "dependencies": {"@portkey-ai/gateway": version},
                       "overrides": PORTKEY_OVERRIDES}, indent=2) + "\n"


def upstream_root(upstream: str) -> str:
    """http://host:port/v1 -> http://host:port (smg wants worker URLs without the API path)."""
    return re.sub(r"/v1/?$", "", upstream.rstrip("/"))


# ----------------------------------------------------------------------------------------------
# The peers


def _litellm(home: Path, upstream: str, port: int, config_dir: Path) -> Launch:
    config = config_dir / "litellm.yaml"
    config.write_text(litellm_config(upstream))
    command = [str(home / "bin" / "litellm"), "--config", str(config), "--host", "127.0.0.1", "--port", str(port)]
    # offline: the model cost map from the package, not fetched from GitHub
    return Launch(command, {"LITELLM_LOCAL_MODEL_COST_MAP": "True"}, Route(api_key=LITELLM_KEY))


def _portkey(home: Path, upstream: str, port: int, config_dir: Path) -> Launch:
    script = home / "node_modules" / "@portkey-ai" / "gateway" / "build" / "start-server.js"
    headers = {"x-portkey-provider": "openai", "x-portkey-custom-host": upstream}
    return Launch(["node", str(script), f"--port={port}"], {}, Route(headers=headers, api_key="unused"))


def _tensorzero(home: Path, upstream: str, port: int, config_dir: Path) -> Launch:
    config, launcher = config_dir / "tensorzero.toml", config_dir / "tensorzero_gateway.py"
    config.write_text(tensorzero_config(upstream))
    launcher.write_text(TENSORZERO_LAUNCHER)
    route = Route(path="/openai/v1", model=f"tensorzero::model_name::{MODEL}")
    return Launch([str(home / "bin" / "python"), str(launcher), str(config)], {}, route, port_from_log=True)


def _smg(home: Path, upstream: str, port: int, config_dir: Path) -> Launch:
    from benchmarks.procs import free_port

    command = [str(home / "bin" / "smg"), "launch", "--backend", "openai", "--worker-urls", upstream_root(upstream),
               "--host", "127.0.0.1", "--port", str(port), "--prometheus-host", "127.0.0.1",
               "--prometheus-port", str(free_port())]
    return Launch(command, {}, Route())


PEERS = {
    "litellm": Peer("litellm", "LiteLLM proxy (Python)", "litellm[proxy]", "pip", _litellm),
    "portkey": Peer("portkey", "Portkey gateway (TypeScript)", "@portkey-ai/gateway", "npm", _portkey),
    "tensorzero": Peer("tensorzero", "TensorZero gateway (Rust)", "tensorzero", "pip", _tensorzero),
    "smg": Peer("smg", "SGLang Model Gateway smg (Rust)", "smg", "pip", _smg),
}


# ----------------------------------------------------------------------------------------------
# Installing


class InstallError(Exception):
    """A peer could not be installed; the message says why (the tail of pip's or npm's output)."""


def install(peer: Peer, version: str, cache: Path = CACHE) -> Path:
    """The peer's folder under `cache`, installed at `version` unless a stamp says it already is (or
    the version found there is that one)."""
    home = cache / peer.name
    stamp = home / f".installed-{version}"
    if stamp.exists() or installed_version(peer, home) == version:
        stamp.write_text(version + "\n")
        return home
    home.mkdir(parents=True, exist_ok=True)
    if peer.kind == "pip":
        _run([sys.executable, "-m", "venv", "--clear", str(home)], cache)
        _run([str(home / "bin" / "pip"), "install", "--quiet", peer.spec(version)], cache)
    else:
        (home / "package.json").write_text(portkey_package(version))
        _run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"], home)
    stamp.write_text(version + "\n")
    return home


def installed_version(peer: Peer, home: Path) -> str | None:
    """The version of the peer found in `home` (None: not installed there)."""
    if peer.kind == "npm":
        manifest = home / "node_modules" / peer.package / "package.json"
        return str(json.loads(manifest.read_text())["version"]) if manifest.exists() else None
    python = home / "bin" / "python"
    if not python.exists():
        return None
    dist = peer.package.split("[")[0]
    probe = f"import importlib.metadata as m; print(m.version({dist!r}))"
    done = subprocess.run([str(python), "-c", probe], capture_output=True, text=True, check=False)
    return (done.stdout.strip() or None) if done.returncode == 0 else None


def _run(command: list[str], cwd: Path) -> None:
    try:
        done = subprocess.run(command, cwd=cwd, capture_output=True, text=True, timeout=INSTALL_TIMEOUT_S, check=False)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise InstallError(f"{command[0]}: {exc}") from exc
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise InstallError(f"`{' '.join(command[:3])}` exited {done.returncode}: {' / '.join(tail)[:300]}")
