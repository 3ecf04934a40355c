"""Where the gateway reaches into uvicorn without a public hook (gateway/server/http.py), and into
Starlette's Response (api/answers.py, api/sse.py: responses made without its __init__), each seam
named: a uvicorn release that moves one fails here, by name, before the behaviour tests of
test_server.py fail in some roundabout way. The pin in pyproject.toml says which releases were tested."""

from __future__ import annotations

import inspect
import re
import tomllib
from pathlib import Path

import pytest
import starlette
import uvicorn
from packaging.specifiers import SpecifierSet
from uvicorn.protocols.http import h11_impl, httptools_impl

ROOT = Path(__file__).parents[2]
# what HeaderTimeout reads or sets on a request cycle (uvicorn's RequestResponseCycle)
CYCLE = ("body", "response_complete", "response_started", "more_body", "keep_alive", "waiting_for_100_continue",
         "scope")
PROTOCOLS = [(httptools_impl.HttpToolsProtocol, httptools_impl.RequestResponseCycle),
             (h11_impl.H11Protocol, h11_impl.RequestResponseCycle)]


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


def test_the_server_seams_are_where_the_drain_reaches() -> None:
    server = uvicorn.Server
    for name in ("capture_signals", "handle_exit", "on_tick", "startup"):
        assert callable(getattr(server, name, None)), name
    source = inspect.getsource(server)
    for name in ("self._captured_signals", "self.should_exit", "self.servers"):
        assert name in source, name


def test_the_installed_starlette_is_in_the_pinned_range() -> None:
    dependencies = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    pin = next(d for d in dependencies if d.startswith("starlette"))
    assert starlette.__version__ in SpecifierSet(pin.removeprefix("starlette"))


def test_a_response_is_sent_from_the_attributes_our_responses_set() -> None:
    from starlette.responses import Response

    source = inspect.getsource(Response.__call__)
    for name in ("self.status_code", "self.raw_headers", "self.body", "self.background"):
        assert name in source, name
