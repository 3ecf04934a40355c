"""The sweep plot: latency and throughput against concurrency, one line per series (matplotlib,
imported only here and only when a plot is drawn; without it there is no plot, and a note)."""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from benchmarks.loadgen.results import Result

if TYPE_CHECKING:  # matplotlib is optional: imported for real only in plot_sweep
    from matplotlib.axes import Axes


def plot_sweep(series: dict[str, Sequence[Result]], path: Path, title: str = "") -> Path | None:
    """Latency (TTFT p50/p99, TPOT p50) and output throughput against concurrency, one line per series."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no plot (pip install matplotlib)", file=sys.stderr)
        return None
    fig, (lat, thr) = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, results in series.items():
        _draw(lat, thr, results, prefix=f"{name} " if len(series) > 1 else "")
    _label(lat, thr)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _draw(lat: Axes, thr: Axes, results: Sequence[Result], prefix: str) -> None:
    """One series: three latency lines on the left, throughput on the right, in one colour."""
    points = sorted((r for r in results if r.concurrency), key=lambda r: r.concurrency)  # type: ignore[arg-type, return-value]
    xs = [r.concurrency for r in points]
    line = lat.plot(xs, [r.ttft.p50 * 1000 for r in points], marker="o", label=f"{prefix}TTFT p50")[0]
    lat.plot(xs, [r.ttft.p99 * 1000 for r in points], marker="^", linestyle="--", color=line.get_color(), label=f"{prefix}TTFT p99")
    lat.plot(xs, [r.tpot.p50 * 1000 for r in points], marker="s", linestyle=":", color=line.get_color(), label=f"{prefix}TPOT p50")
    thr.plot(xs, [r.output_throughput for r in points], marker="o", color=line.get_color(), label=f"{prefix}output tok/s")


def _label(lat: Axes, thr: Axes) -> None:
    """Axes, scales, grids, legends and titles of both panels."""
    for ax in (lat, thr):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrency (requests in flight)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    lat.set_yscale("log")
    lat.set_ylabel("ms")
    lat.set_title("latency")
    thr.set_ylim(bottom=0)
    thr.set_ylabel("output tokens / s")
    thr.set_title("throughput")
