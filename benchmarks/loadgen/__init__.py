"""A load generator for any OpenAI-compatible server: `python -m benchmarks.loadgen`, or
`await run_load(LoadConfig(...)) -> Result` (benchmarks/README.md says what it measures)."""

from benchmarks.loadgen.client import SSEDecoder, StreamAccumulator, make_client, send_request
from benchmarks.loadgen.prompts import ServerTokenizer, Session, build_sessions, request_body, sessions_needed
from benchmarks.loadgen.results import LoadConfig, RequestRecord, Result, aggregate, metrics_of, percentile
from benchmarks.loadgen.runner import main, run_async, run_load, run_sweep, shared_endpoint

__all__ = ["LoadConfig", "RequestRecord", "Result", "SSEDecoder", "ServerTokenizer", "Session",
           "StreamAccumulator", "aggregate", "build_sessions", "main", "make_client", "metrics_of", "percentile",
           "request_body", "run_async", "run_load", "run_sweep", "send_request", "sessions_needed", "shared_endpoint"]
