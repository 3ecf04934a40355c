"""What dispatch answers with: JSON already written goes out as Starlette's Response would send it."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from starlette.responses import Response

from gateway.api.answers import JSONBytes


async def _sent(response: Response) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b""}

    async def send(message: dict[str, Any]) -> None:
        messages.append(message)

    await response({"type": "http"}, receive, send)
    return messages


@pytest.mark.parametrize("body", [b'{"id":"cmpl-1","object":"text_completion"}', b"", '{"t":"é"}'.encode()])
def test_json_bytes_is_what_response_sends(body: bytes) -> None:
    ours, theirs = JSONBytes(body), Response(body, media_type="application/json")
    assert asyncio.run(_sent(ours)) == asyncio.run(_sent(theirs))
    assert ours.headers == theirs.headers
    assert ours.media_type == theirs.media_type
    assert ours.raw_headers == [(b"content-length", str(len(body)).encode()), (b"content-type", b"application/json")]
