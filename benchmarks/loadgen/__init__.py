"""A load generator for any OpenAI-compatible server: `python -m benchmarks.loadgen`, or
`await run_load(LoadConfig(...)) -> Result` (benchmarks/README.md says what it measures)."""

from benchmarks.loadgen.client import SSEDecoder, StreamAccumulator, make_client, send_request
from benchmarks.loadgen.prompts import ServerTokenizer, Session, build_sessions, request_body, sessions_needed
from benchmarks.loadgen.results import (
    WANTED_HEADROOM,
    LoadConfig,
    RequestRecord,
    Result,
    Stats,
    aggregate,
    compare,
    describe,
    percentile,
    plot_sweep,
    point,
    tpot,
)
from benchmarks.loadgen.runner import main, run_async, run_load, run_sweep, shared_endpoint

__all__ = [
    "WANTED_HEADROOM", "LoadConfig", "RequestRecord", "Result", "SSEDecoder", "ServerTokenizer", "Session", "Stats",
    "StreamAccumulator", "aggregate", "build_sessions", "compare", "describe", "main", "make_client", "percentile",
    "plot_sweep", "point", "request_body", "run_async", "run_load", "run_sweep", "send_request", "sessions_needed",
    "shared_endpoint", "tpot",
]
