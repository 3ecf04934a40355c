"""The command line, `python -m benchmarks.loadgen`: flags into a `LoadConfig` (each flag's dest is
the field's name), the runs (a sweep of concurrency levels or one Poisson run), the JSON and the plot."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from benchmarks.loadgen.config import LoadConfig
from benchmarks.loadgen.results import format_result, plot_sweep, point
from benchmarks.loadgen.runner import run_async, run_load, run_sweep
from benchmarks.procs import RESULTS, timestamp


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen",
                                description="A load generator for any OpenAI-compatible server (benchmarks/README.md)")
    add = p.add_argument
    add("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL (with /v1)")
    add("--model", help="model name (default: the first of GET /models)")
    add("--endpoint", choices=["chat", "completions"], default="chat")
    add("--concurrency", type=int, nargs="+",
        help="requests in flight (default 8); several levels: a sweep; with --request-rate: a cap (default none)")
    add("--request-rate", type=float, help="Poisson arrivals per second instead (concurrency becomes a cap)")
    add("--num-requests", type=int, default=64, help="requests per run (per concurrency level)")
    add("--waves", type=int, help="at least WAVES x concurrency requests per level")
    add("--duration", dest="duration_s", type=float, default=300.0, help="time limit of each run in seconds (0: none)")
    add("--prompts", choices=["random", "shared-prefix", "multi-turn"], default="random")
    add("--input-tokens", type=int, default=128, help="tokens per prompt (per user turn)")
    add("--output-tokens", type=int, default=64, help="max_tokens of every request")
    add("--prefix-tokens", type=int, default=512, help="shared-prefix: tokens of the common prefix")
    add("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    add("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    add("--unique-prompts", type=int, help="cycle through this many prompts (1: the same request again)")
    add("--ignore-eos", action="store_true", help="send ignore_eos (vLLM): exactly --output-tokens tokens")
    add("--temperature", type=float, default=0.0, help="sampling temperature (negative: server default)")
    add("--no-stream", dest="stream", action="store_false", help="non-streaming requests (TTFT = e2e)")
    add("--extra-body", type=json.loads, default={}, help="JSON object merged into every request body")
    add("--api-key")
    add("--count-header", dest="count_headers", action="append", help="response header whose values are counted (default x-cache)")
    add("--tokenizer", choices=["auto", "server", "words"], default="auto",
        help="count prompt tokens with the server's /tokenize (auto: when present) or as words")
    add("--seed", type=int, default=0)
    add("--warmup", dest="warmup_requests", type=int, default=0, help="warm-up requests before each run (not measured)")
    add("--request-timeout", dest="request_timeout_s", type=float, default=600.0)
    add("--output", type=Path, help="JSON results file (default benchmarks/results/loadgen-<time>.json)")
    add("--plot", type=Path, help="PNG plot (default: next to the JSON when several levels are run)")
    add("--no-plot", action="store_true")
    add("--save-requests", dest="keep_records", action="store_true", help="put every request's record in the JSON")
    add("--ceiling-duration", dest="ceiling_s", type=float, default=2.0,
        help="after each run: seconds of the same load against the instant endpoint (benchmarks.instant_endpoint), "
             "the client's ceiling, reported beside the run")
    add("--no-ceiling", dest="ceiling_s", action="store_const", const=0.0, help="skip the ceiling run")
    return p


def config_from(args: argparse.Namespace) -> LoadConfig:
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(LoadConfig) if hasattr(args, f.name)}
    return dataclasses.replace(
        LoadConfig(**given),
        concurrency=args.concurrency[0] if args.concurrency else (None if args.request_rate else 8),
        duration_s=args.duration_s or None, temperature=None if args.temperature < 0 else args.temperature,
        count_headers=[h.lower() for h in args.count_headers or ["x-cache"]],
    )


def main(argv: list[str] | None = None) -> int:
    """Run (one Poisson run at --request-rate, else a sweep of the --concurrency levels), write the JSON
    (and the plot of a sweep); exit status 1 when a run completed nothing."""
    args = parser().parse_args(argv)
    config = config_from(args)
    if args.request_rate:
        results = [run_async(run_load(dataclasses.replace(config, label=f"rate={args.request_rate}")))]
        print(format_result(results[0]), file=sys.stderr)
    else:
        results = run_async(run_sweep(config, args.concurrency or [8], args.waves))
    stamp = timestamp()
    output = args.output or RESULTS / f"loadgen-{stamp}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    document = {"tool": "benchmarks.loadgen", "started": stamp, "argv": sys.argv if argv is None else ["loadgen", *argv],
                "config": config.to_dict(), "results": [r.to_dict(records=args.keep_records) for r in results]}
    output.write_text(json.dumps(document, indent=2))
    print(f"results: {output}", file=sys.stderr)
    if not args.no_plot and (args.plot or len(results) > 1):
        plot = plot_sweep({"": [point(r) for r in results]}, args.plot or output.with_suffix(".png"), title=args.base_url)
        if plot:
            print(f"plot: {plot}", file=sys.stderr)
    return 0 if all(r.completed for r in results) else 1
