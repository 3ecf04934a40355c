"""What a run measured: one `RequestRecord` per request, and their `aggregate`, a `Result` (counts,
throughput, latency statistics: `Stats`, percentiles as numpy computes them) that `to_dict()` turns
into plain JSON."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low, high = math.floor(rank), math.ceil(rank)
    return float(ordered[low] + (ordered[high] - ordered[low]) * (rank - low))


@dataclass
class Stats:
    """mean, p50, p90, p99, min, max of a list of seconds (NaN when empty)."""

    n: int = 0
    mean: float = math.nan
    p50: float = math.nan
    p90: float = math.nan
    p99: float = math.nan
    min: float = math.nan
    max: float = math.nan

    @classmethod
    def of(cls, values: Sequence[float]) -> Stats:
        values = [v for v in values if v is not None and not math.isnan(v)]
        if not values:
            return cls()
        p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
        return cls(len(values), sum(values) / len(values), p50, p90, p99, min(values), max(values))

    def to_dict(self) -> dict[str, float | int | None]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in dataclasses.asdict(self).items()}


def tpot(e2e: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
    return None if output_tokens is None or output_tokens < 2 else (e2e - ttft) / (output_tokens - 1)


@dataclass
class RequestRecord:
    """One request: how it ended, its timings (seconds), its tokens and the headers counted."""

    start: float = 0.0  # seconds since the run started
    ok: bool = False
    cancelled: bool = False
    status: int | None = None
    error: str | None = None
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    input_tokens: int = 0
    cached_tokens: int | None = None
    chunks: int = 0
    usage_reported: bool = False
    headers: dict[str, str] = field(default_factory=dict)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        if not self.ok or self.ttft is None or self.e2e is None or self.chunks == 0:
            return None
        return tpot(self.e2e, self.ttft, self.output_tokens)

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data.pop("text")
        data["tpot"] = self.tpot
        return data


@dataclass
class Result:
    """One run at one concurrency (or request rate), summed up."""

    label: str
    concurrency: int | None
    request_rate: float | None
    duration_s: float
    completed: int
    failed: int
    cancelled: int
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float  # completed requests per second
    output_throughput: float  # output tokens of completed requests per second
    input_throughput: float
    total_token_throughput: float
    ttft: Stats
    tpot: Stats
    itl: Stats
    e2e: Stats
    mean_input_tokens: float
    mean_output_tokens: float
    mean_cached_tokens: float | None
    usage_reported: bool
    errors: dict[str, int]
    header_counts: dict[str, dict[str, int]]
    config: dict[str, Any] = field(default_factory=dict)
    records: list[RequestRecord] = field(default_factory=list)
    client_cpu_s: float | None = None  # the load generator's own CPU seconds during the run
    ceiling: dict[str, Any] | None = None  # the client's ceiling beside this run (loadgen.ceiling.compare)

    @property
    def client_cpu_share(self) -> float | None:
        """The client's CPU during the run in cores (1.0: one core busy all the time)."""
        if self.client_cpu_s is None or self.duration_s <= 0:
            return None
        return self.client_cpu_s / self.duration_s

    def to_dict(self, records: bool = False) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "records"}
        data["client_cpu_share"] = self.client_cpu_share
        if records:
            data["records"] = [r.to_dict() for r in self.records]
        return _clean(data)


def _clean(value: Any) -> Any:
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_clean(v) for v in value]
    return value


def aggregate(records: Sequence[RequestRecord], duration_s: float, *, label: str = "", concurrency: int | None = None,
              request_rate: float | None = None, config: dict[str, Any] | None = None, keep_records: bool = False) -> Result:
    """The `Result` of a run's records: throughput over `duration_s`, latencies of the completed ones."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok and not r.cancelled]
    out_tokens, in_tokens = sum(r.output_tokens for r in ok), sum(r.input_tokens for r in ok)
    duration = max(duration_s, 1e-9)
    cached = [r.cached_tokens for r in ok if r.cached_tokens is not None]
    headers: dict[str, Counter[str]] = {}  # how often each value of each counted header came back
    for r in records:
        for name, value in r.headers.items():
            headers.setdefault(name, Counter())[value] += 1
    return Result(
        label, concurrency, request_rate, duration_s, len(ok), len(failed), sum(r.cancelled for r in records),
        in_tokens, out_tokens, len(ok) / duration, out_tokens / duration, in_tokens / duration,
        (in_tokens + out_tokens) / duration,
        ttft=Stats.of([r.ttft for r in ok if r.ttft is not None]), tpot=Stats.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Stats.of([x for r in ok for x in r.itl]), e2e=Stats.of([r.e2e for r in ok if r.e2e is not None]),
        mean_input_tokens=in_tokens / len(ok) if ok else math.nan,
        mean_output_tokens=out_tokens / len(ok) if ok else math.nan,
        mean_cached_tokens=(sum(cached) / len(cached)) if cached else None,
        usage_reported=bool(ok) and all(r.usage_reported for r in ok),
        errors=dict(Counter((r.error or "unknown error")[:200] for r in failed)),
        header_counts={k: dict(v) for k, v in headers.items()}, config=config or {},
        records=list(records) if keep_records else [],
    )
