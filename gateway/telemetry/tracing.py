"""OpenTelemetry traces after the GenAI semantic conventions: the gateway's own provider (never installed as the
global one: vLLM installs its own) and one request's trace. With tracing off there is no `RequestTrace`: a stage
costs one check of `record.trace`."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Iterable, Mapping
from contextlib import AbstractContextManager
from typing import Any

from opentelemetry import context as otel_context
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor, SpanExporter
from opentelemetry.sdk.trace.sampling import ParentBased, TraceIdRatioBased
from opentelemetry.trace import NonRecordingSpan, Span, SpanKind, Status, StatusCode, Tracer, set_span_in_context
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from gateway.settings import TracingSettings

PROPAGATOR = TraceContextTextMapPropagator()  # W3C traceparent and tracestate
SCOPE_NAME = "llm-gateway"

# the route → gen_ai.operation.name (the conventions' well-known values)
OPERATIONS = {
    "/v1/chat/completions": "chat",
    "/v1/completions": "text_completion",
    "/v1/embeddings": "embeddings",
    "/v1/messages": "chat",
    "/v1/responses": "chat",
}
# a request's field → its attribute; the first field a request sets wins (max_tokens has three names)
PARAMETERS = (
    ("temperature", "gen_ai.request.temperature"),
    ("top_p", "gen_ai.request.top_p"),
    ("top_k", "gen_ai.request.top_k"),
    ("max_completion_tokens", "gen_ai.request.max_tokens"),
    ("max_tokens", "gen_ai.request.max_tokens"),
    ("max_output_tokens", "gen_ai.request.max_tokens"),
    ("frequency_penalty", "gen_ai.request.frequency_penalty"),
    ("presence_penalty", "gen_ai.request.presence_penalty"),
    ("seed", "gen_ai.request.seed"),
    ("n", "gen_ai.request.choice.count"),
    ("dimensions", "gen_ai.embeddings.dimension.count"),
)


class Tracing:
    """The gateway's tracer provider: spans sampled by trace id (a caller's traceparent decides for its own trace),
    batched and exported over OTLP/HTTP. `exporter`: another exporter (tests), exported span by span."""

    def __init__(self, settings: TracingSettings, exporter: SpanExporter | None = None) -> None:
        resource = Resource.create({"service.name": settings.service_name})
        sampler = ParentBased(TraceIdRatioBased(settings.sample_ratio))
        self.provider = TracerProvider(resource=resource, sampler=sampler)
        if exporter is None:
            otlp = OTLPSpanExporter(endpoint=settings.otlp_endpoint, timeout=settings.export_timeout_s)
            timeout_ms = int(settings.export_timeout_s * 1000)
            self.provider.add_span_processor(BatchSpanProcessor(otlp, export_timeout_millis=timeout_ms))
        else:
            self.provider.add_span_processor(SimpleSpanProcessor(exporter))
        self.tracer: Tracer = self.provider.get_tracer(SCOPE_NAME)


def continued(headers: Iterable[tuple[bytes, bytes]]) -> otel_context.Context:
    carrier = {k.decode("latin-1"): v.decode("latin-1") for k, v in headers if k in (b"traceparent", b"tracestate")}
    return PROPAGATOR.extract(carrier) if carrier else otel_context.Context()


def headers_of(span: Span) -> dict[str, str]:
    """`traceparent` (and `tracestate`) naming `span` as the parent: for a remote upstream."""
    carrier: dict[str, str] = {}
    PROPAGATOR.inject(carrier, context=set_span_in_context(span))
    return carrier


class RequestTrace:
    __slots__ = ("_failed", "_finish_reasons", "_overrides", "log_content", "recording", "server", "tracer")

    def __init__(self, tracer: Tracer, server: Span, log_content: bool = False) -> None:
        self.tracer = tracer
        self.server = server
        # sampled: a request not sampled gets no child spans (only its traceparent goes on), so that
        # a low sample_ratio costs little more than tracing off
        self.recording = server.is_recording()
        self.log_content = log_content
        self._finish_reasons: list[str] = []
        self._overrides: dict[int, str] = {}  # choice index → the chat layer's reason (tool_calls)
        self._failed = False

    def ids(self) -> dict[str, str]:
        span_context = self.server.get_span_context()
        return {"trace_id": f"{span_context.trace_id:032x}", "span_id": f"{span_context.span_id:016x}"}

    def start(self, name: str, kind: SpanKind = SpanKind.INTERNAL, attributes: Mapping[str, Any] | None = None) -> Span:
        """A child span not made current, for a stage that spans a stream's yields, ended by its owner. Not sampled:
        the server span itself, which the tracing middleware ends."""
        if not self.recording:
            return NonRecordingSpan(self.server.get_span_context())  # its end() does nothing
        return self.tracer.start_span(name, kind=kind, attributes=attributes)

    def request(self, route: str, model: str, body: object) -> None:
        """The request's operation, model and sampling parameters; the span renamed `{operation} {model}` as the
        conventions name an inference span."""
        if not self.recording:
            return
        operation = OPERATIONS.get(route, "chat")
        span = self.server
        span.update_name(f"{operation} {model}")
        span.set_attribute("gen_ai.operation.name", operation)
        span.set_attribute("gen_ai.request.model", model)
        span.set_attributes(parameters(body))

    def finished(self, reasons: Iterable[str | None]) -> None:
        self._finish_reasons.extend(reason or "stop" for reason in reasons)

    def finished_as(self, index: int, reason: str | None) -> None:
        if reason is not None:
            self._overrides[index] = reason

    def failed(self, error_type: str, exc: BaseException) -> None:
        """A server error the API answered, or a stream's failure after its first byte: recorded on the span."""
        self._failed = True
        self.server.record_exception(exc)
        self.server.set_attribute("error.type", error_type)
        self.server.set_status(Status(StatusCode.ERROR, f"{type(exc).__name__}"))

    def end(self, record: Any) -> None:
        span = self.server
        if span.is_recording():
            reasons = list(self._finish_reasons)
            for index, reason in self._overrides.items():  # the chat layer's, over the engine's
                if index < len(reasons):
                    reasons[index] = reason
                else:
                    reasons.append(reason)
            span.set_attributes(_answered(record, reasons))
            if self.log_content:
                span.set_attributes(_content(record, reasons))
            status = record.status or 500
            if status >= 500 and not record.disconnected and not self._failed:
                span.set_attribute("error.type", str(status))
                span.set_status(Status(StatusCode.ERROR))
        span.end()


def parameters(body: object) -> dict[str, Any]:
    attributes: dict[str, Any] = {}
    for field, attribute in PARAMETERS:
        value = getattr(body, field, None)
        if isinstance(value, int | float) and not isinstance(value, bool) and attribute not in attributes:
            attributes[attribute] = value
    stop = getattr(body, "stop", None)
    if stop:
        attributes["gen_ai.request.stop_sequences"] = [stop] if isinstance(stop, str) else [str(s) for s in stop]
    if getattr(body, "stream", False):
        attributes["gateway.request.stream"] = True
    return attributes


def _answered(record: Any, reasons: list[str]) -> dict[str, Any]:
    attributes = {
        "http.response.status_code": record.status or 500,
        "gen_ai.response.model": record.version,
        "gen_ai.usage.input_tokens": record.prompt_tokens,
        "gen_ai.usage.output_tokens": record.completion_tokens,
        "gen_ai.response.finish_reasons": reasons or None,
        "gateway.cache": record.cache,
        "gateway.api_key_id": record.api_key_id,
        "gateway.guards": list(record.guards) if record.guards else None,
        "gateway.client_disconnected": True if record.disconnected else None,
        "gateway.ttft_s": record.ttft_s,
    }
    return {name: value for name, value in attributes.items() if value is not None}


def _content(record: Any, reasons: list[str]) -> dict[str, str]:
    content = {}
    if record.prompt is not None:
        messages = [{"role": "user", "parts": [{"type": "text", "content": record.prompt}]}]
        content["gen_ai.input.messages"] = json.dumps(messages)
    if record.output is not None:
        outputs = [
            {"role": "assistant", "parts": [{"type": "text", "content": text}],
             "finish_reason": reasons[index] if index < len(reasons) else None}
            for index, text in enumerate(record.output)
        ]
        content["gen_ai.output.messages"] = json.dumps(outputs)
    return content


_UNTRACED: contextlib.nullcontext[None] = contextlib.nullcontext()


def stage(trace: RequestTrace | None, name: str, **attributes: Any) -> AbstractContextManager[Span | None]:
    """A child span made current for a stage that runs within one await (none when not sampled)."""
    if trace is None or not trace.recording:
        return _UNTRACED
    return trace.tracer.start_as_current_span(name, attributes=attributes or None)

