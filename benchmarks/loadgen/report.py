"""A run for people: the summary printed on stderr, and the UTC timestamp that names result files."""

from __future__ import annotations

import math
from datetime import UTC, datetime

from benchmarks.loadgen.ceiling import describe
from benchmarks.loadgen.results import Result
from benchmarks.loadgen.stats import Stats


def _ms(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value * 1000:.1f}"


def format_result(r: Result) -> str:
    """A few lines: counts, throughput, then mean/p50/p90/p99 of TTFT, TPOT, ITL and e2e in ms."""
    mode = f"rate={r.request_rate}/s" if r.request_rate else f"concurrency={r.concurrency}"
    lines = [
        f"[{r.label or mode}] {mode}: {r.completed} ok, {r.failed} failed, {r.cancelled} cancelled in {r.duration_s:.2f} s",
        f"  throughput: {r.request_throughput:.2f} req/s, {r.output_throughput:.1f} output tok/s, "
        f"{r.input_throughput:.1f} input tok/s (mean {r.mean_input_tokens:.1f} in / {r.mean_output_tokens:.1f} out"
        + (f", {r.mean_cached_tokens:.1f} cached" if r.mean_cached_tokens is not None else "")
        + (", usage from server" if r.usage_reported else ", output tokens counted as chunks")
        + ")",
    ]
    for name in ("ttft", "tpot", "itl", "e2e"):
        s: Stats = getattr(r, name)
        lines.append(f"  {name:5s} ms: mean {_ms(s.mean)}  p50 {_ms(s.p50)}  p90 {_ms(s.p90)}  p99 {_ms(s.p99)}  (n={s.n})")
    if r.errors:
        lines.append("  errors: " + "; ".join(f"{n}x {e}" for e, n in list(r.errors.items())[:5]))
    if r.header_counts:
        lines.append("  headers: " + ", ".join(f"{h}: {dict(c)}" for h, c in r.header_counts.items()))
    share = r.client_cpu_share
    if share is not None and r.client_cpu_s is not None:
        per = r.client_cpu_s * 1e6 / max(1, r.completed + r.failed)
        lines.append(f"  client CPU: {share:.2f} of a core ({per:.0f} us per request)")
    if r.ceiling:
        lines.append("  " + describe(r.ceiling))
    return "\n".join(lines)


def timestamp() -> str:
    """Now in UTC, e.g. 20261130T002618Z."""
    return datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
