"""The seams docs/development.md lists ("Seams"): where the gateway reaches into a dependency's
internals, each named here, so that a release that moves one fails here, by name,
before the behaviour tests (test_server.py, test_workers) fail in some roundabout way. The pin in
pyproject.toml says which uvicorn releases were tested."""

from __future__ import annotations

import importlib.util
import inspect
import re
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import uvicorn
from packaging.specifiers import SpecifierSet
from uvicorn.protocols.http import h11_impl, httptools_impl

ROOT = Path(__file__).parents[2]
# what HeaderTimeout, send_400_response and the 100-continue close read or set on a request cycle
CYCLE = ("body", "response_complete", "response_started", "more_body", "keep_alive", "waiting_for_100_continue",
         "scope")
PROTOCOLS = [(httptools_impl.HttpToolsProtocol, httptools_impl.RequestResponseCycle),
             (h11_impl.H11Protocol, h11_impl.RequestResponseCycle)]


def test_every_seam_is_listed_once() -> None:
    """The table in docs/development.md is the one list: each of its rows names code that exists."""
    text = (ROOT / "docs/development.md").read_text()
    rows = [line for line in text[text.index("- Seams:"):].splitlines() if line.startswith("  | ")][1:]
    assert len(rows) == 8
    source = "".join((ROOT / path).read_text()
                     for path in ("gateway/server/http.py", "engine/shared.py", "gateway/telemetry/metrics.py"))
    for row in rows:
        for name in re.findall(r"`([\w.]+)`", row.split("|")[2]):  # where: the module, the class or function
            if not name.endswith(".py"):
                assert re.search(rf"\b{re.escape(name.split('.')[-1])}\b", source), (row, name)


def test_the_installed_uvicorn_is_in_the_pinned_range() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in dependencies if d.startswith("uvicorn"))
    assert uvicorn.__version__ in SpecifierSet(pin.split("]", 1)[1])


@pytest.mark.parametrize(("protocol", "cycle"), PROTOCOLS)
def test_the_protocol_seams_are_where_the_gateway_reaches(protocol: type, cycle: type) -> None:
    assert callable(getattr(protocol, "send_400_response", None))  # overridden: the 400 in the API's shape
    assert callable(getattr(protocol, "data_received", None))
    assert callable(getattr(protocol, "connection_made", None))
    protocol_source = inspect.getsource(protocol)
    for name in ("self.cycle", "self.server_state"):  # the request in progress, the default headers
        assert re.search(rf"{re.escape(name)}\b", protocol_source), name
    cycle_init = inspect.getsource(cycle.__init__)
    for name in CYCLE:
        assert re.search(rf"self\.{name}\b", cycle_init), f"RequestResponseCycle.{name}"
    assert inspect.iscoroutinefunction(cycle.send)  # wrapped per request (Expect: 100-continue)


def test_the_httptools_seams_of_trailers_and_http_1_0() -> None:
    """httptools' protocol appends a chunked body's trailers to the headers' list after
    `on_headers_complete`; its cycle frames an answer by `chunked_encoding` and counts down
    `expected_content_length` (an HTTP/1.0 stream, close-delimited)."""
    protocol = httptools_impl.HttpToolsProtocol
    assert callable(getattr(protocol, "on_headers_complete", None))
    assert "self.url" in inspect.getsource(protocol)  # the path parsed so far (send_400_response)
    cycle_source = inspect.getsource(httptools_impl.RequestResponseCycle)
    for name in ("chunked_encoding", "expected_content_length"):
        assert re.search(rf"self\.{name}\b", cycle_source), name


def test_the_server_seams_are_where_the_drain_reaches() -> None:
    server = uvicorn.Server
    for name in ("capture_signals", "handle_exit", "on_tick", "startup"):
        assert callable(getattr(server, name, None)), name
    assert "self.servers" in inspect.getsource(server)
    assert "self.should_exit = True" in inspect.getsource(uvicorn_handle_exit())  # the drain's end


def uvicorn_handle_exit() -> Any:
    """uvicorn's own `Server.handle_exit`: sse_starlette (which the mcp SDK's server side imports) wraps it when
    imported, in a function that calls it after noting the exit for its own streams."""
    handle_exit = uvicorn.Server.handle_exit
    patched = sys.modules.get("sse_starlette.sse")
    if patched is not None and handle_exit is patched.AppStatus.handle_exit:
        return patched.AppStatus.original_handler
    return handle_exit


def test_vllm_takes_the_api_process_fields_the_shared_core_sets() -> None:
    """engine/shared.py sets them by dataclasses.replace: fields of AsyncEngineArgs (read from its
    source: a unit test imports no vLLM)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or spec.origin is None:
        pytest.skip("vLLM is not installed")
    source = (Path(spec.origin).parent / "engine/arg_utils.py").read_text()
    arguments = source[source.index("class EngineArgs"):]
    for name in ("_api_process_count", "_api_process_rank"):
        assert re.search(rf"^    {name}: int\b", arguments, re.MULTILINE), name


def test_observations_add_up_to_the_same_exposition_as_observe() -> None:
    """metrics.Observations writes into prometheus_client's histogram child (`_upper_bounds`,
    `_buckets`, `_sum`): the exposition must equal observe's, bucket by bucket, for values on,
    between and past the bounds, before and after a flush."""
    from prometheus_client import CollectorRegistry, Histogram, generate_latest
    from prometheus_client.parser import text_string_to_metric_families

    from gateway.telemetry.metrics import TOKEN_BUCKETS, Observations

    values = [0.0, 0.001, 0.0011, 0.05, 0.3, 4.9, 5.0, 7.5, 1e9, -0.5] * 10  # more than FLUSH_EVERY in all
    registry = {name: CollectorRegistry() for name in ("observe", "observations")}
    histograms = {
        name: Histogram("gaps_seconds", "gaps", ["model"], buckets=TOKEN_BUCKETS, registry=registry[name])
        for name in registry
    }
    for value in values:
        histograms["observe"].labels("m").observe(value)
    observations = Observations(histograms["observations"].labels("m"))
    for value in values[:70]:
        observations.add(value)

    def exposed(name: str) -> dict[tuple[str, str], float]:
        families = text_string_to_metric_families(generate_latest(registry[name]).decode())
        return {(s.name, s.labels.get("le", "")): s.value for f in families for s in f.samples if "_created" not in s.name}

    assert exposed("observations") != exposed("observe")  # 6 still pending
    for value in values[70:]:
        observations.add(value)
    observations.flush()
    observations.flush()  # nothing pending: adds nothing
    observed, added = exposed("observe"), exposed("observations")
    assert added == pytest.approx(observed, rel=1e-12)  # the sum adds in another order
    assert len(observed) == len(TOKEN_BUCKETS) + 3  # the buckets, +Inf, count, sum
