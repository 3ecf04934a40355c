"""JSON on the hot paths: a stream's chunks as bytes, which `api.sse` frames (per token), and a
cached answer's stored JSON under a new id and time (per cache hit)."""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

import orjson
from pydantic import BaseModel


class ChunkEncoder:
    """A stream's chunks as JSON: the fields that never change (id, object, created, model) are
    serialized once per stream; per token only the choices, JSON-ready dicts, go through orjson
    (pydantic per token costs more: benchmarks/RESULTS.md)."""

    def __init__(self, id: str, object: str, created: int, model: str, service_tier: str | None = None) -> None:
        head: dict[str, Any] = {"id": id, "object": object, "created": created, "model": model}
        if service_tier is not None:
            head["service_tier"] = service_tier
        self._head = orjson.dumps(head)[:-1] + b',"choices":'

    def __call__(self, choices: list[dict[str, Any]], usage: BaseModel | None = None) -> bytes:
        body = self._head + orjson.dumps(choices)
        if usage is not None:
            body += b',"usage":' + usage.__pydantic_serializer__.to_json(usage, exclude_none=True)
        return body + b"}"


class Renewal:
    """A cached answer's JSON (as `ResponseCache` stores it: the model's, without None fields)
    under a new id and time, as the service's `fresh` then `json_response` would write it, but
    without parsing and serializing the answer: its head (`{"id":..,"object":..,"created":..,`,
    the model's first fields in their order) is written anew and the rest kept as it is. None
    for JSON that does not open so (an id with escapes, say): then the model has to do it."""

    def __init__(self, kind: str, new_id: Callable[[], str], now: Callable[[], int]) -> None:
        self._kind = kind.encode()
        self._new_id, self._now = new_id, now
        self._head = re.compile(rb'\{"id":"[^"\\]*","object":"' + re.escape(self._kind) + rb'","created":-?[0-9]+,')

    def __call__(self, raw: bytes) -> bytes | None:
        head = self._head.match(raw)
        if head is None:
            return None
        fresh = b'{"id":"%s","object":"%s","created":%d,' % (self._new_id().encode(), self._kind, self._now())
        return fresh + raw[head.end() :]
