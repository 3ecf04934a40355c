"""The handlers' request helpers (gateway.web.requests) read the scope directly where Starlette's
Request would build objects: the same values as through the Request."""

from __future__ import annotations

import pytest
from starlette.requests import Request

from gateway.pipeline.context import SCOPE_KEY, context_of
from gateway.web.requests import body_size, state_of


def test_the_state_is_the_lifespan_s_and_the_body_size_the_request_context_s() -> None:
    gateway = object()
    request = Request({"type": "http", "headers": [], "state": {"gateway": gateway}})
    assert state_of(request) is gateway is request.state.gateway
    assert body_size(request) == 0
    context_of(request.scope).body_bytes = 12  # the one typed per-request object, not a state key
    assert body_size(request) == 12
    assert request.scope[SCOPE_KEY].body_bytes == 12
    with pytest.raises(AttributeError):  # no lifespan state: request.state's error, as before
        state_of(Request({"type": "http", "headers": []}))
    assert body_size(Request({"type": "http", "headers": []})) == 0


async def test_a_content_length_of_other_digits_is_not_a_server_error() -> None:
    """'²' passes str.isdigit() but not int(): the declared length is ignored, the body read as it comes."""
    from gateway.web.requests import read_body

    messages = [{"type": "http.request", "body": b"{}", "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0)

    request = Request({"type": "http", "headers": [(b"content-length", "²".encode("latin-1"))]}, receive)
    assert await read_body(request, 100) == b"{}"
