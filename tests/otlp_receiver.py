"""A small OTLP/HTTP traces receiver (on port 0, its port read back): what a gateway under test
exports, decoded span by span (tests/integration: the session's gateway sends it its traces)."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from tests.waits import until_sync

WAIT_S = 60  # a bound on waiting for the batches (exported every 5 s), not a measurement


class Receiver:
    """An OTLP/HTTP traces endpoint: every span it was sent, decoded, with its service name."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.lock = threading.Lock()

    def take(self, body: bytes) -> None:
        request = ExportTraceServiceRequest.FromString(body)
        with self.lock:
            for resource in request.resource_spans:
                service = _attributes(resource.resource.attributes).get("service.name")
                for scope in resource.scope_spans:
                    self.spans.extend(_span(span, service) for span in scope.spans)

    def found(self, name: str, trace_id: str) -> dict[str, Any] | None:
        with self.lock:
            return next((s for s in self.spans if s["name"] == name and s["trace_id"] == trace_id), None)

    def wait_for(self, name: str, trace_id: str) -> dict[str, Any]:
        return until_sync(lambda: self.found(name, trace_id), WAIT_S, f"a span {name!r} in trace {trace_id}", step_s=0.1)


def _value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind == "array_value":
        return [_value(v) for v in value.array_value.values]
    return getattr(value, kind) if kind else None


def _attributes(pairs: Any) -> dict[str, Any]:
    return {pair.key: _value(pair.value) for pair in pairs}


def _span(span: Any, service: str | None) -> dict[str, Any]:
    return {
        "name": span.name, "service": service, "trace_id": span.trace_id.hex(), "span_id": span.span_id.hex(),
        "parent": span.parent_span_id.hex(), "kind": span.kind, "attributes": _attributes(span.attributes),
    }


@contextlib.contextmanager
def receiver() -> Iterator[tuple[Receiver, int]]:
    """The receiver served on a port it bound itself (port 0), and that port."""
    spans = Receiver()

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            spans.take(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", "0")
            self.end_headers()

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield spans, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
