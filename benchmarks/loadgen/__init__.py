"""A load generator for any OpenAI-compatible server: `python -m benchmarks.loadgen`, or
`await run_load(LoadConfig(...)) -> Result` (benchmarks/README.md says what it measures and which
module does what).
"""

from benchmarks.loadgen import ceiling
from benchmarks.loadgen.cli import main
from benchmarks.loadgen.client import make_client, send_request
from benchmarks.loadgen.config import LoadConfig
from benchmarks.loadgen.prompts import ServerTokenizer, Session, build_sessions, request_body, sessions_needed
from benchmarks.loadgen.report import plot_sweep
from benchmarks.loadgen.results import RequestRecord, Result, Stats, aggregate, percentile, tpot
from benchmarks.loadgen.runner import run_async, run_load, run_sweep
from benchmarks.loadgen.sse import SSEDecoder, StreamAccumulator

__all__ = [
    "LoadConfig", "RequestRecord", "Result", "SSEDecoder", "ServerTokenizer", "Session", "Stats", "StreamAccumulator",
    "aggregate", "build_sessions", "ceiling", "main", "make_client", "percentile", "plot_sweep", "request_body",
    "run_async", "run_load", "run_sweep", "send_request", "sessions_needed", "tpot",
]
