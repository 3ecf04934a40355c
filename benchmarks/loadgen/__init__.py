"""A load generator for any OpenAI-compatible server (this gateway, vLLM's server, others).

    python -m benchmarks.loadgen --base-url http://127.0.0.1:8000/v1 --concurrency 1 4 16 64 \
        --num-requests 64 --input-tokens 128 --output-tokens 64 --ignore-eos

Load: a fixed number of requests in flight (`--concurrency`, several levels make a sweep), or
Poisson arrivals at `--request-rate` requests per second (with `--concurrency` as a cap). Every run
stops by itself: after `--num-requests` requests or `--duration` seconds, whichever comes first.

Prompts (`--prompts`): `random` (random words fitted to `--input-tokens` tokens with the server's
`/tokenize` when it has one, else one word per token), `shared-prefix` (a long common prefix of
`--prefix-tokens` and a short unique part: prefix caching at work), `multi-turn` (chats of
`--turns` turns, each turn carrying the whole conversation so far).

Per request: time to first token (TTFT), time per output token after the first (TPOT = (e2e -
TTFT) / (output tokens - 1)), inter-token latencies (between stream chunks that carry text), end
to end latency. Output tokens come from the usage the server reports (`stream_options:
{"include_usage": true}`), else from the number of chunks carrying text.

The client (aiohttp on uvloop, keep-alive connections, bodies encoded once, streams split into
events at blank lines without decoding; with `processes` > 1, the CLI's default on a machine with
several cores, the load split over worker processes and their records merged) is meant never to
be the bottleneck, and every run shows whether it was: `Result.client_cpu_s` is the client's own
CPU during the run, and with `ceiling_s` (the CLI's default: 2 s) the same load is sent right
after to the instant endpoint (`benchmarks.instant_endpoint`), whose rate is reported beside the
run as the client's ceiling (`Result.ceiling`, wanted ≥ 5×).

Importable: `await run_load(LoadConfig(...)) -> Result`. No vllm import, no tokenizer needed.

The package, in the order a request flows:
    config      LoadConfig: what a run does
    prompts     the workload: random-word prompts, sessions, request bodies (tokenizer: the server's)
    runner      run_load and run_sweep: workers or Poisson arrivals, warm-up, time limit (progress: the bar);
                run_async (uvloop)
    workers     the load from several processes (worker: the process), records merged into one run
    ceiling     the client's ceiling: the same load against the instant endpoint, beside the run
    client      the aiohttp session and send_request, which times one request (sse: reading a stream)
    results     RequestRecord, Result and aggregate (stats: percentiles, TPOT)
    report      the summary on stderr; plot: the sweep plot; cli: the command line and its JSON file
    codec       JSON on the hot path (orjson when installed)
This module re-exports the public names of the former single-file loadgen.py, so that
`benchmarks.loadgen.<name>` (used by race.py, race_report.py, engine_direct.py, the tests) works as before.
"""

from benchmarks.loadgen.cli import RESULTS_DIR, config_from, main, parser
from benchmarks.loadgen.client import discover_model, make_client, send_request
from benchmarks.loadgen.config import LoadConfig
from benchmarks.loadgen.plot import plot_sweep
from benchmarks.loadgen.prompts import WORDS, Session, build_sessions, fit_text, request_body, sessions_needed
from benchmarks.loadgen.report import format_result, timestamp
from benchmarks.loadgen.results import RequestRecord, Result, aggregate
from benchmarks.loadgen.runner import measure_ceiling, run_async, run_load, run_sweep
from benchmarks.loadgen.sse import SSEDecoder, StreamAccumulator, sse_events
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
    "sse_events",
    "timestamp",
    "tpot",
]
