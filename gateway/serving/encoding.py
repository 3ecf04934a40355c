"""Chunk encoding on the per-token path: a stream's chunks as JSON bytes, which `api.sse` frames."""

from __future__ import annotations

from typing import Any

import orjson
from pydantic import BaseModel


class ChunkEncoder:
    """A stream's chunks as JSON: the fields that never change (id, object, created, model) are
    serialized once per stream; per token only the choices, JSON-ready dicts, go through orjson
    (pydantic per token cost ~10% of a streamed token's CPU: benchmarks/RESULTS.md)."""

    def __init__(self, id: str, object: str, created: int, model: str) -> None:
        head = {"id": id, "object": object, "created": created, "model": model}
        self._head = orjson.dumps(head)[:-1] + b',"choices":'

    def __call__(self, choices: list[dict[str, Any]], usage: BaseModel | None = None) -> bytes:
        body = self._head + orjson.dumps(choices)
        if usage is not None:
            body += b',"usage":' + usage.__pydantic_serializer__.to_json(usage, exclude_none=True)
        return body + b"}"
