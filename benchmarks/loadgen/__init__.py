"""A load generator for any OpenAI-compatible server: `python -m benchmarks.loadgen`, or
`await run_load(LoadConfig(...)) -> Result` (benchmarks/README.md says what it measures).

Modules, in the order a request flows: config (LoadConfig), prompts + tokenizer (the workload),
runner (run_load, run_sweep, run_async; progress: the bar), client + sse + wire (the HTTP client),
ceiling (the same load against the instant endpoint), results + stats, report, plot, cli.
"""

from benchmarks.loadgen.cli import RESULTS_DIR, config_from, main, parser
from benchmarks.loadgen.client import discover_model, make_client, send_request
from benchmarks.loadgen.config import LoadConfig
from benchmarks.loadgen.plot import plot_sweep
from benchmarks.loadgen.prompts import WORDS, Session, build_sessions, fit_text, request_body, sessions_needed
from benchmarks.loadgen.report import format_result, timestamp
from benchmarks.loadgen.results import RequestRecord, Result, aggregate
from benchmarks.loadgen.runner import measure_ceiling, run_async, run_load, run_sweep
from benchmarks.loadgen.sse import SSEDecoder, StreamAccumulator
from benchmarks.loadgen.stats import Stats, percentile, tpot
from benchmarks.loadgen.tokenizer import ServerTokenizer, get_tokenizer, root_url

__all__ = [
    "RESULTS_DIR",
    "WORDS",
    "LoadConfig",
    "RequestRecord",
    "Result",
    "SSEDecoder",
    "ServerTokenizer",
    "Session",
    "Stats",
    "StreamAccumulator",
    "aggregate",
    "build_sessions",
    "config_from",
    "discover_model",
    "fit_text",
    "format_result",
    "get_tokenizer",
    "main",
    "make_client",
    "measure_ceiling",
    "parser",
    "percentile",
    "plot_sweep",
    "request_body",
    "root_url",
    "run_async",
    "run_load",
    "run_sweep",
    "send_request",
    "sessions_needed",
    "timestamp",
    "tpot",
]
