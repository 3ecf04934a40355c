"""The race's peers part without its servers: the configuration written for each peer, how a
peer's install is found or refused, the turns, and the summary and tables built from the runs.
Nothing here installs or starts a peer."""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from benchmarks import peer_gateways, peers
from benchmarks.peer_gateways import PEERS

UPSTREAM = "http://127.0.0.1:4321/v1"


# ---------------------------------------------------------------------------------------------
# configuration


def test_litellm_config_routes_the_model_to_the_upstream() -> None:
    config = yaml.safe_load(peer_gateways.litellm_config(UPSTREAM))
    (model,) = config["model_list"]
    assert model["model_name"] == "bare"
    assert model["litellm_params"] == {"model": "openai/bare", "api_base": UPSTREAM, "api_key": "none"}
    assert config["general_settings"]["master_key"] == peer_gateways.LITELLM_KEY


def test_tensorzero_config_has_one_openai_provider_at_the_upstream() -> None:
    config = tomllib.loads(peer_gateways.tensorzero_config(UPSTREAM))
    model = config["models"]["bare"]
    assert model["routing"] == ["mock"]
    assert model["providers"]["mock"] == {"type": "openai", "model_name": "bare", "api_base": UPSTREAM + "/",
                                          "api_key_location": "none"}


def test_tensorzero_port_is_read_from_the_launcher_line() -> None:
    log = "WARN Disabling observability\nBASE_URL http://127.0.0.1:39327/openai/v1\n"
    assert peer_gateways.tensorzero_port(log) == 39327
    assert peer_gateways.tensorzero_port("WARN Disabling observability\n") is None
    assert peer_gateways.tensorzero_port("see BASE_URL http://127.0.0.1:1/ later\n") is None  # not at a line's start


def test_portkey_package_pins_the_gateway_and_holds_back_node_server() -> None:
    package = json.loads(peer_gateways.portkey_package("1.15.2"))
    assert package["dependencies"] == {"@portkey-ai/gateway": "1.15.2"}
    assert package["overrides"] == {"@hono/node-server": "1.13.5"}


@pytest.mark.parametrize(("url", "root"), [("http://h:1/v1", "http://h:1"), ("http://h:1/v1/", "http://h:1"),
                                           ("http://h:1", "http://h:1"), ("http://v1:1/v1", "http://v1:1")])
def test_upstream_root(url: str, root: str) -> None:
    assert peer_gateways.upstream_root(url) == root


def test_each_launch_points_at_the_upstream(tmp_path: Path) -> None:
    home = tmp_path / "home"
    launches = {name: peer.launch(home, UPSTREAM, 5555, tmp_path) for name, peer in PEERS.items()}
    litellm, portkey, tensorzero, smg = (launches[n] for n in ("litellm", "portkey", "tensorzero", "smg"))
    assert yaml.safe_load((tmp_path / "litellm.yaml").read_text())["model_list"][0]["litellm_params"]["api_base"] == UPSTREAM
    assert litellm.command[litellm.command.index("--port") + 1] == "5555"
    assert litellm.route.api_key == peer_gateways.LITELLM_KEY
    assert portkey.command[-1] == "--port=5555"
    assert portkey.route.headers == {"x-portkey-provider": "openai", "x-portkey-custom-host": UPSTREAM}
    assert tensorzero.port_from_log
    assert (tensorzero.route.path, tensorzero.route.model) == ("/openai/v1", "tensorzero::model_name::bare")
    assert tomllib.loads((tmp_path / "tensorzero.toml").read_text())["models"]["bare"]["providers"]["mock"]["api_base"] == UPSTREAM + "/"
    assert smg.command[smg.command.index("--worker-urls") + 1] == "http://127.0.0.1:4321"
    assert smg.command[smg.command.index("--backend") + 1] == "openai"
    assert smg.command[smg.command.index("--port") + 1] == "5555"
    assert smg.command[smg.command.index("--prometheus-port") + 1] != "5555"


# ---------------------------------------------------------------------------------------------
# installing (never for real)


def test_an_installed_npm_peer_is_found_and_not_installed_again(tmp_path: Path) -> None:
    portkey = PEERS["portkey"]
    manifest = tmp_path / "portkey" / "node_modules" / "@portkey-ai" / "gateway" / "package.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text(json.dumps({"version": "9.9.9"}))
    assert peer_gateways.installed_version(portkey, tmp_path / "portkey") == "9.9.9"
    assert peer_gateways.install(portkey, "9.9.9", cache=tmp_path) == tmp_path / "portkey"  # no npm run
    assert (tmp_path / "portkey" / ".installed-9.9.9").exists()
    assert peer_gateways.installed_version(PEERS["smg"], tmp_path / "smg") is None


def test_a_failed_install_says_why(tmp_path: Path) -> None:
    with pytest.raises(peer_gateways.InstallError, match="exited 1"):
        peer_gateways._run(["false"], tmp_path)
    with pytest.raises(peer_gateways.InstallError, match="no-such-installer"):
        peer_gateways._run(["no-such-installer"], tmp_path)


# ---------------------------------------------------------------------------------------------
# turns, summary, tables


def test_rotation_puts_each_slot_first_once() -> None:
    slots: list[Any] = ["a", "b", "c"]
    firsts = [peers.rotation(slots, turn)[0] for turn in range(3)]
    assert sorted(firsts) == slots
    assert all(sorted(peers.rotation(slots, turn)) == slots for turn in range(5))


def _run(target: str, repeat: int, level: int, req_s: float, p50: float, mode: str = "plain",
         ttfb: float | None = None, cpu: float | None = 0.5, failed: int = 0) -> dict[str, Any]:
    return {"mode": mode, "repeat": repeat, "level": level, "target": target, "req_s": req_s, "p50_ms": p50,
            "p99_ms": 2 * p50, "ttfb_p50_ms": ttfb, "ttfb_p99_ms": None if ttfb is None else 3 * ttfb,
            "failed": failed, "errors": {}, "cpu_ms": cpu, "load1": 1.0 + repeat}


def _document() -> dict[str, Any]:
    runs = []
    for repeat, (mock, ours, aa, smg) in enumerate([(0.1, 1.1, 1.2, 0.6), (0.2, 1.0, 1.0, 0.5), (0.1, 1.5, 1.1, 0.4)]):
        runs += [_run("mock", repeat, 1, 10_000, mock, cpu=None), _run("llm-gateway", repeat, 1, 1000 / ours, ours),
                 _run("llm-gateway-aa", repeat, 1, 1000 / aa, aa), _run("smg", repeat, 1, 1000 / smg, smg, failed=1)]
        runs += [_run("mock", repeat, 1, 5000, mock, "stream", ttfb=0.1, cpu=None),
                 _run("llm-gateway", repeat, 1, 800, ours, "stream", ttfb=0.1 + ours)]
    return {"command": "python -m benchmarks.peers", "settings": {"repeats": 3}, "runs": runs, "machine": {"nproc": 2},
            "targets": ["mock", "llm-gateway", "llm-gateway-aa", "smg"],
            "peers": [{"name": "smg", "title": "SGLang Model Gateway smg (Rust)", "version": "1.13.0", "status": "ran",
                       "reason": "answered"},
                      {"name": "litellm", "title": "LiteLLM proxy (Python)", "version": "1.108.7",
                       "status": "not installed", "reason": "pip exited 1: no route to host"}]}


def test_summary_pairs_each_round_with_its_mock_and_takes_medians() -> None:
    document = _document()
    peers.summarize(document)
    row = {(r["mode"], r["target"]): r for r in document["summary"]}
    ours, smg = row[("plain", "llm-gateway")], row[("plain", "smg")]
    assert ours["p50_ms"] == pytest.approx(1.1)
    assert ours["added_p50_ms"] == pytest.approx(1.0)  # median of 1.0, 0.8, 1.4
    assert ours["added_p99_ms"] == pytest.approx(2.0)  # median of 2.0, 1.6, 2.8
    assert smg["req_s"] == pytest.approx(2000)
    assert smg["failed"] == 3
    assert row[("plain", "mock")]["cpu_ms"] is None
    assert row[("plain", "mock")]["added_p50_ms"] is None
    assert row[("stream", "llm-gateway")]["added_ttfb_ms"] == pytest.approx(1.1)  # median of 1.1, 1.0, 1.5
    assert row[("stream", "llm-gateway")]["added_ttfb_p99_ms"] == pytest.approx(3.3)
    (aa,) = [a for a in document["aa"] if a["mode"] == "plain"]
    # per round: (1000/1.2)/(1000/1.1), 1.0, (1000/1.1)/(1000/1.5)
    assert (aa["min"], aa["median"], aa["max"]) == pytest.approx((1.1 / 1.2, 1.0, 1.5 / 1.1))


def test_render_lists_every_peer_and_a_headline_per_mode() -> None:
    document = _document()
    peers.summarize(document)
    text = peers.render(document)
    assert "| LiteLLM proxy (Python) | 1.108.7 | not installed | pip exited 1: no route to host |" in text
    headline = peers.headline(document, "plain")
    assert headline[0].startswith("| gateway | c=1 req/s | added p50 ms at c=1 | added p99 ms at c=1 |")
    smg = next(line for line in headline if line.startswith("| SGLang Model Gateway smg 1.13.0 (Rust) |"))
    assert smg.split(" | ")[1:3] == ["2,000", "0.30"]  # req/s, added p50 (median of 0.5, 0.3, 0.3)
    assert smg.rstrip(" |").endswith("| 3")  # failed
    mock = next(line for line in headline if line.startswith("| mock alone"))
    assert "—" in mock
    stream = peers.headline(document, "stream")
    assert "added TTFB p50 ms at c=1" in stream[0]
    assert not any("SGLang" in line for line in stream)  # no streamed runs of smg
    assert "A/A" in text
    assert "plain c=1 1.00 [0.92, 1.36]" in text
    assert "Load average (1 min) over the runs: 1.0 to 3.0, median 2.0, on 2 cores" in text
