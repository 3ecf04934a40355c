"""JSON on the load generator's hot path: orjson when it is installed, else the standard json."""

from __future__ import annotations

import json
from typing import Any

try:  # orjson is a dependency of the gateway; plain json works too
    import orjson

    loads = orjson.loads  # no wrapper: called once per streamed event
    dumps = orjson.dumps

except ImportError:  # pragma: no cover

    def loads(data: str | bytes) -> Any:
        return json.loads(data)

    def dumps(obj: Any) -> bytes:
        return json.dumps(obj).encode()
