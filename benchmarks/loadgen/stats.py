"""The statistics of a run: percentiles as numpy computes them, a latency summary, TPOT."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation between ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    if len(ordered) == 1:
        return float(ordered[0])
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = math.ceil(rank)
    fraction = rank - low
    return float(ordered[low] + (ordered[high] - ordered[low]) * fraction)


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
        return cls(
            n=len(values),
            mean=sum(values) / len(values),
            p50=percentile(values, 50),
            p90=percentile(values, 90),
            p99=percentile(values, 99),
            min=min(values),
            max=max(values),
        )

    def to_dict(self) -> dict[str, float | int | None]:
        return {k: (None if isinstance(v, float) and math.isnan(v) else v) for k, v in dataclasses.asdict(self).items()}


def tpot(e2e: float, ttft: float, output_tokens: int) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (output_tokens - 1)."""
    if output_tokens is None or output_tokens < 2:
        return None
    return (e2e - ttft) / (output_tokens - 1)
