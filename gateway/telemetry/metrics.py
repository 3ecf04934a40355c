"""Every Prometheus metric of the gateway, declared once, and the exposition GET /metrics serves: these and vLLM's
own `vllm:` statistics, registered in the same default registry, except `vllm:lora_requests_info` (`AdapterInfo`)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    REGISTRY,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.multiprocess import MultiProcessCollector
from prometheus_client.registry import Collector

from engine.types import AdapterLoad

# Buckets wide enough for a CPU (seconds per token) and a GPU (milliseconds per token).
LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 0.75, 1, 2.5, 5)

REQUESTS = Counter("gateway_requests_total", "Requests answered", ["model", "route", "status"])
REQUEST_DURATION = Histogram(
    "gateway_request_duration_seconds", "Time from request to the last byte", ["model", "route"],
    buckets=LATENCY_BUCKETS,
)
TIME_TO_FIRST_TOKEN = Histogram(
    "gateway_time_to_first_token_seconds", "Time from request to the first generated token", ["model"],
    buckets=LATENCY_BUCKETS,
)
INTER_TOKEN_LATENCY = Histogram(
    "gateway_inter_token_latency_seconds", "Time between successive engine outputs of a request", ["model"],
    buckets=TOKEN_BUCKETS,
)
TIME_PER_OUTPUT_TOKEN = Histogram(
    "gateway_time_per_output_token_seconds", "(last token time - first token time) / (tokens - 1)", ["model"],
    buckets=TOKEN_BUCKETS,
)
PROMPT_TOKENS = Counter("gateway_prompt_tokens_total", "Prompt tokens processed", ["model"])
COMPLETION_TOKENS = Counter("gateway_completion_tokens_total", "Completion tokens generated", ["model"])
# with worker processes (`aggregate_workers`): the sum over the workers alive
IN_FLIGHT = Gauge("gateway_requests_in_flight", "Requests being generated", ["model"], multiprocess_mode="livesum")
WAITING = Gauge("gateway_requests_waiting", "Requests waiting for admission", ["model"], multiprocess_mode="livesum")
CACHE_HITS = Counter("gateway_cache_hits_total", "Response cache hits", ["model"])
CACHE_MISSES = Counter("gateway_cache_misses_total", "Response cache misses", ["model"])
CACHE_ERRORS = Counter("gateway_cache_errors_total", "Cache backend failures (served uncached)", ["backend"])
RATE_LIMITED = Counter("gateway_rate_limited_total", "Requests refused by rate limits", ["limit"])
# reason: queue_full, expected_wait, deadline_passed, queue_timeout
REJECTED = Counter("gateway_rejected_total", "Requests refused by admission control", ["model", "reason"])
ADMISSION_LIMIT = Gauge(
    "gateway_admission_limit", "Engine requests admission lets run at once (the measured limit)", ["model"],
    multiprocess_mode="livesum",
)
UPSTREAM_ERRORS = Counter("gateway_upstream_errors_total", "Failures of remote upstream models", ["model"])
FALLBACKS = Counter("gateway_fallbacks_total", "Requests answered by a fallback model", ["model", "fallback"])
STREAM_FAILOVERS = Counter(
    "gateway_stream_failovers_total", "Streams continued on a fallback model after their first byte", ["model", "fallback"],
)
GUARD_ACTIONS = Counter(
    "gateway_guard_actions_total", "Guard actions: block, redact, flag, error (of the moderation upstream)",
    ["guard", "stage", "action"],
)
DISCONNECTS = Counter("gateway_client_disconnects_total", "Clients gone before their answer ended", ["model"])
# Usage per API key, for charge-back: `key` is the key's id (the keys file's names, the hash ids of
# GATEWAY_API_KEYS, or "anonymous": a bounded set), `team` the keys file's team ("" when none).
KEY_REQUESTS = Counter("gateway_key_requests_total", "Requests answered (2xx) per API key", ["key", "team"])
KEY_PROMPT_TOKENS = Counter("gateway_key_prompt_tokens_total", "Prompt tokens processed per API key", ["key", "team"])
KEY_COMPLETION_TOKENS = Counter(
    "gateway_key_completion_tokens_total", "Completion tokens generated per API key", ["key", "team"]
)
QUOTA_REFUSED = Counter("gateway_quota_refused_total", "Requests refused by a key's token budget", ["key", "period"])
LIMITS_REDIS_ERRORS = Counter(
    "gateway_limits_redis_errors_total", "Failures of the shared limits' Redis (limits counted in process meanwhile)",
    ["operation"],
)
LIMITS_LOCAL = Counter(
    "gateway_limits_local_decisions_total", "Limit and budget decisions made in process because Redis was down"
)
MCP_TOOL_CALLS = Counter(
    "gateway_mcp_tool_calls_total", "Tool calls through /mcp, by server, tool and outcome (ok, error, refused, "
    "rate_limited); a tool no listing named counts as tool=other", ["server", "tool", "outcome"],
)
MCP_TOOL_CALL_DURATION = Histogram(
    "gateway_mcp_tool_call_duration_seconds", "Tool calls through /mcp: the server's time to answer", ["server"],
    buckets=LATENCY_BUCKETS,
)
KEYS_RELOADS = Counter("gateway_keys_reloads_total", "Reloads of the keys file, by result", ["result"])
TLS_RELOADS = Counter("gateway_tls_reloads_total", "Reloads of the TLS certificate files, by result", ["result"])

LORA_INFO = "vllm:lora_requests_info"


class _Ours(GaugeMetricFamily):
    """`AdapterInfo`'s family: told apart from vLLM's gauge of the same name in the exposition."""


class AdapterInfo(Collector):
    """`vllm:lora_requests_info` with vLLM's labels and value, read from each engine's `adapter_load` at scrape time:
    through the engine interface, and on the CPU `max_lora` is what the engine holds (vLLM's own counts a spare
    slot, `engine.vllm_engine.CPU_SPARE_LORA_SLOTS`). One series per engine (the same labels twice: the latest)."""

    def __init__(self) -> None:
        self.loads: Callable[[], Iterable[AdapterLoad | None]] = lambda: ()
        self.serving = False  # once the engines started: vLLM's own gauge is left out of the exposition

    def collect(self) -> Iterator[Metric]:
        series: dict[tuple[str, str, str], float] = {}
        for load in self.loads():
            if load is not None:
                labels = (str(load.max_loras), ",".join(load.waiting), ",".join(load.running))
                series[labels] = max(series.get(labels, 0.0), load.updated)
        if not series:
            return
        family = _Ours(LORA_INFO, "Running stats on lora requests.",
                       labels=["max_lora", "waiting_lora_adapters", "running_lora_adapters"])
        for labels, updated in series.items():
            family.add_metric(list(labels), updated)
        yield family


ADAPTER_INFO = AdapterInfo()
REGISTRY.register(ADAPTER_INFO)  # it names nothing until an engine serves adapters: no name clash with vLLM's


def export_adapter_load(loads: Callable[[], Iterable[AdapterLoad | None]]) -> None:
    """Serve `vllm:lora_requests_info` from `loads` in place of the gauge each vLLM engine registers."""
    ADAPTER_INFO.loads = loads
    ADAPTER_INFO.serving = True


M = TypeVar("M", Counter, Gauge, Histogram)
_children: dict[tuple[int, tuple[str, ...]], object] = {}


def labelled(metric: M, *values: str) -> M:
    """`metric.labels(*values)`, remembered: prometheus_client takes a lock on every `labels()` call, and keeps every
    label set for ever anyway, so this holds nothing more than it does."""
    key = (id(metric), values)
    child = _children.get(key)
    if child is None:
        child = _children[key] = metric.labels(*values)
    return child  # type: ignore[return-value]


class _Exposed(CollectorRegistry):
    """A registry's families, less vLLM's `vllm:lora_requests_info` once `AdapterInfo` serves it."""

    def __init__(self, source: CollectorRegistry) -> None:
        super().__init__(auto_describe=False)
        self.source = source

    def collect(self) -> Iterator[Metric]:
        for family in self.source.collect():
            if family.name != LORA_INFO or isinstance(family, _Ours) or not ADAPTER_INFO.serving:
                yield family


_exposed = _Exposed(REGISTRY)


class Observations:
    """Observations of one histogram child, counted per bucket here and added to it every `FLUSH_EVERY` and at the end
    (`flush`): prometheus_client's `observe` takes two locks and scans the buckets, once per streamed token here.
    A seam (docs/development.md, "Seams"): no public call adds many observations at once."""

    FLUSH_EVERY = 64

    __slots__ = ("_bounds", "_child", "_counts", "_pending", "_sum")

    def __init__(self, child: Histogram) -> None:
        self._child = child
        self._bounds: list[float] = child._upper_bounds  # noqa: SLF001 - a seam (docs/development.md); ends with +Inf
        self._counts = [0] * len(self._bounds)
        self._sum = 0.0
        self._pending = 0

    def add(self, value: float) -> None:
        self._counts[bisect_left(self._bounds, value)] += 1  # the first bucket with value <= bound, as observe
        self._sum += value
        self._pending += 1
        if self._pending >= self.FLUSH_EVERY:
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        buckets = self._child._buckets  # noqa: SLF001 - a seam (docs/development.md)
        for index, count in enumerate(self._counts):
            if count:
                buckets[index].inc(count)
                self._counts[index] = 0
        self._child._sum.inc(self._sum)  # noqa: SLF001 - a seam (docs/development.md)
        self._sum, self._pending = 0.0, 0


def aggregate_workers() -> None:
    """In a worker process (its parent set PROMETHEUS_MULTIPROC_DIR): the exposition adds up every worker's files;
    `AdapterInfo` is served as this worker's engines see it."""
    global _exposed
    registry = CollectorRegistry()
    MultiProcessCollector(registry)  # type: ignore[no-untyped-call]
    registry.register(ADAPTER_INFO)
    _exposed = _Exposed(registry)


def exposition() -> tuple[bytes, str]:
    return generate_latest(_exposed), CONTENT_TYPE_LATEST
