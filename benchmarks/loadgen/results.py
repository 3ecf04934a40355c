"""What one run is (`LoadConfig`: the CLI's flags, one for one) and what it measured: a
`RequestRecord` per request, their `aggregate` (a `Result`), its numbers flat (`metrics_of`), the
client's ceiling beside it (`compare`, `describe`), and a run for people (`format_result`)."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

WANTED_HEADROOM = 5.0  # the client's ceiling ÷ the run's rate, below which the client may be what was measured


@dataclass
class LoadConfig:
    base_url: str = "http://127.0.0.1:8000/v1"
    model: str | None = None  # None: the first of GET /models
    endpoint: Literal["chat", "completions"] = "chat"
    concurrency: int | None = 8  # requests in flight; with request_rate: a cap (None: no cap)
    request_rate: float | None = None  # Poisson arrivals per second (None: as fast as concurrency allows)
    num_requests: int = 64
    duration_s: float | None = 300.0  # hard time limit of the measured run
    prompts: Literal["random", "shared-prefix", "multi-turn"] = "random"
    input_tokens: int = 128
    output_tokens: int = 64
    prefix_tokens: int = 512  # shared-prefix: length of the common prefix
    num_prefixes: int = 1  # shared-prefix: how many distinct prefixes
    turns: int = 4  # multi-turn: user turns per conversation
    unique_prompts: int | None = None  # cycle through this many prompts (None: every one new)
    ignore_eos: bool = False  # vLLM's extension: always generate output_tokens tokens
    temperature: float | None = 0.0  # None: the server's default
    stream: bool = True
    extra_body: dict[str, Any] = field(default_factory=dict)
    headers: dict[str, str] = field(default_factory=dict)
    api_key: str | None = None
    count_headers: list[str] = field(default_factory=lambda: ["x-cache"])
    tokenizer: Literal["auto", "server", "words"] = "auto"
    seed: int = 0
    warmup_requests: int = 0  # sent before the measured run, with their own prompts, not counted
    request_timeout_s: float = 600.0
    keep_records: bool = False  # put every request's record in Result.to_dict()
    ceiling_s: float = 0.0  # after the run: seconds of the same load against the instant endpoint (0: none)
    label: str = ""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        if data.get("api_key"):
            data["api_key"] = "***"
        return data


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
        if not (values := [v for v in values if v is not None and not math.isnan(v)]):
            return cls()
        p50, p90, p99 = (percentile(values, q) for q in (50, 90, 99))
        return cls(len(values), sum(values) / len(values), p50, p90, p99, min(values), max(values))


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


@dataclass
class Result:
    """One run at one concurrency (or request rate), summed up; throughputs per second of the run."""

    label: str
    concurrency: int | None
    request_rate: float | None
    duration_s: float
    completed: int
    failed: int
    cancelled: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float  # output tokens of completed requests
    input_throughput: float
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
    ceiling: dict[str, Any] | None = None  # the client's ceiling beside this run (`compare`)

    @property
    def client_cpu_share(self) -> float | None:
        """The client's CPU during the run in cores (1.0: one core busy all the time)."""
        return None if self.client_cpu_s is None or self.duration_s <= 0 else self.client_cpu_s / self.duration_s

    def to_dict(self, records: bool = False) -> dict[str, Any]:
        data = {k: v for k, v in dataclasses.asdict(self).items() if k != "records"}
        data["client_cpu_share"] = self.client_cpu_share
        if records:
            data["records"] = [{k: v for k, v in dataclasses.asdict(r).items() if k != "text"} | {"tpot": r.tpot} for r in self.records]
        return dict(_clean(data))


def _clean(value: Any) -> Any:
    """NaN -> None, recursively (JSON has no NaN)."""
    if isinstance(value, float) and math.isnan(value):
        return None
    if isinstance(value, dict):
        return {k: _clean(v) for k, v in value.items()}
    return [_clean(v) for v in value] if isinstance(value, list) else value


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
        out_tokens, len(ok) / duration, out_tokens / duration, in_tokens / duration,
        ttft=Stats.of([r.ttft for r in ok if r.ttft is not None]), tpot=Stats.of([t for r in ok if (t := r.tpot) is not None]),
        itl=Stats.of([x for r in ok for x in r.itl]), e2e=Stats.of([r.e2e for r in ok if r.e2e is not None]),
        mean_input_tokens=in_tokens / len(ok) if ok else math.nan, mean_output_tokens=out_tokens / len(ok) if ok else math.nan,
        mean_cached_tokens=(sum(cached) / len(cached)) if cached else None,
        usage_reported=bool(ok) and all(r.usage_reported for r in ok),
        errors=dict(Counter((r.error or "unknown error")[:200] for r in failed)),
        header_counts={k: dict(v) for k, v in headers.items()}, config=config or {},
        records=list(records) if keep_records else [],
    )


LATENCIES = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("itl", "p99"), ("e2e", "p50"), ("e2e", "p99"))


def metrics_of(result: dict[str, Any]) -> dict[str, Any]:
    """A `Result.to_dict()` as the commands' tables read it: rates, latencies in ms (`ttft_p50_ms`, ...),
    failed (cancelled included) and the client's headroom (its ceiling ÷ this run)."""
    stats = {f"{stat}_{p}_ms": (result.get(stat) or {}).get(p) for stat, p in LATENCIES}
    return {"output_tok_s": result.get("output_throughput"), "req_s": result.get("request_throughput"),
            **{name: None if s is None else s * 1000 for name, s in stats.items()},
            "mean_output_tokens": result.get("mean_output_tokens"), "completed": result.get("completed", 0),
            "failed": result.get("failed", 0) + result.get("cancelled", 0),
            "client_headroom": (result.get("ceiling") or {}).get("headroom")}


def compare(bare: Result, measured: Result) -> dict[str, Any]:
    """The client's ceiling (`bare`: the same load against the instant endpoint) beside the measured
    run: its rates, the headroom (ceiling ÷ measured) and whether it is enough; `latency_bound`: one
    request at a time, bound by a loopback round trip's latency, not by the client's CPU."""
    req = bare.request_throughput / measured.request_throughput if measured.request_throughput > 0 else None
    tok = bare.output_throughput / measured.output_throughput if measured.output_throughput > 0 else None
    headroom = min((r for r in (req, tok) if r is not None), default=None)
    return {"req_s": bare.request_throughput, "output_tok_s": bare.output_throughput, "completed": bare.completed,
            "failed": bare.failed, "duration_s": bare.duration_s, "client_cpu_s": bare.client_cpu_s,
            "endpoint": "benchmarks.instant_endpoint",
            "latency_bound": bare.config.get("concurrency") == 1 and not bare.config.get("request_rate"),
            "headroom_req_s": req, "headroom_tok_s": tok, "headroom": headroom,
            "enough": headroom is not None and headroom >= WANTED_HEADROOM}


def describe(ceiling: dict[str, Any]) -> str:
    """The ceiling in one line for people."""
    text = (f"client ceiling (instant endpoint, same load, {ceiling['duration_s']:.1f} s): {ceiling['req_s']:.0f} req/s, "
            f"{ceiling['output_tok_s']:.0f} tok/s")
    if (headroom := ceiling.get("headroom")) is None:
        return text + " (nothing measured to compare)"
    text += f" = {headroom:.1f}x this run"
    if not ceiling["enough"]:
        text += f" - below {WANTED_HEADROOM:.0f}x: the client may be part of what this run measured"
        if ceiling.get("latency_bound"):
            text += " (at concurrency 1 the ceiling is one loopback round trip at a time, bound by latency, not by the client's CPU)"
    return text + (f"; {ceiling['failed']} failed" if ceiling.get("failed") else "")


def _ms(value: float | None) -> str:
    return "-" if value is None or math.isnan(value) else f"{value * 1000:.1f}"


def format_result(r: Result) -> str:
    """A few lines: counts, throughput, then mean/p50/p90/p99 of TTFT, TPOT, ITL and e2e in ms."""
    mode = f"rate={r.request_rate}/s" if r.request_rate else f"concurrency={r.concurrency}"
    lines = [
        f"[{r.label or mode}] {mode}: {r.completed} ok, {r.failed} failed, {r.cancelled} cancelled in {r.duration_s:.2f} s",
        f"  throughput: {r.request_throughput:.2f} req/s, {r.output_throughput:.1f} output tok/s, "
        f"{r.input_throughput:.1f} input tok/s (mean {r.mean_input_tokens:.1f} in / {r.mean_output_tokens:.1f} out"
        + (f", {r.mean_cached_tokens:.1f} cached" if r.mean_cached_tokens is not None else "")
        + (", usage from server)" if r.usage_reported else ", output tokens counted as chunks)"),
        *(f"  {name:5s} ms: mean {_ms(s.mean)}  p50 {_ms(s.p50)}  p90 {_ms(s.p90)}  p99 {_ms(s.p99)}  (n={s.n})"
          for name, s in (("ttft", r.ttft), ("tpot", r.tpot), ("itl", r.itl), ("e2e", r.e2e))),
    ]
    if r.errors:
        lines.append("  errors: " + "; ".join(f"{n}x {e}" for e, n in list(r.errors.items())[:5]))
    if r.header_counts:
        lines.append("  headers: " + ", ".join(f"{h}: {dict(c)}" for h, c in r.header_counts.items()))
    if (share := r.client_cpu_share) is not None and r.client_cpu_s is not None:
        lines.append(f"  client CPU: {share:.2f} of a core ({r.client_cpu_s * 1e6 / max(1, r.completed + r.failed):.0f} us per request)")
    return "\n".join(lines + (["  " + describe(r.ceiling)] if r.ceiling else []))
