"""A run for people: the summary printed on stderr, and the sweep plot (matplotlib, imported only when
a plot is drawn; without it there is no plot, and a note)."""

from __future__ import annotations

import math
import sys
from collections.abc import Sequence
from pathlib import Path

from benchmarks.loadgen.ceiling import describe
from benchmarks.loadgen.results import Result, Stats


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


def plot_sweep(series: dict[str, Sequence[Result]], path: Path, title: str = "") -> Path | None:
    """Latency (TTFT p50/p99, TPOT p50; left) and output throughput (right) against concurrency, one colour
    per series."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, results in series.items():
        prefix = f"{name} " if len(series) > 1 else ""
        points = sorted((r for r in results if r.concurrency), key=lambda r: r.concurrency or 0)
        xs = [r.concurrency for r in points]
        color = lat.plot(xs, [r.ttft.p50 * 1000 for r in points], marker="o", label=f"{prefix}TTFT p50")[0].get_color()
        lat.plot(xs, [r.ttft.p99 * 1000 for r in points], marker="^", linestyle="--", color=color, label=f"{prefix}TTFT p99")
        lat.plot(xs, [r.tpot.p50 * 1000 for r in points], marker="s", linestyle=":", color=color, label=f"{prefix}TPOT p50")
        thr.plot(xs, [r.output_throughput for r in points], marker="o", color=color, label=f"{prefix}output tok/s")
    for ax, ylabel, name in ((lat, "ms", "latency"), (thr, "output tokens / s", "throughput")):
        ax.set(xlabel="concurrency (requests in flight)", ylabel=ylabel, title=name)
        ax.set_xscale("log", base=2)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    lat.set_yscale("log")
    thr.set_ylim(bottom=0)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
