"""The command line, `python -m benchmarks.loadgen`: flags into a `LoadConfig`, the runs (a sweep of
concurrency levels or one Poisson run), the JSON document and the plot."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.loadgen.config import LoadConfig
from benchmarks.loadgen.report import format_result, plot_sweep
from benchmarks.loadgen.results import Result
from benchmarks.loadgen.runner import run_async, run_load, run_sweep
from benchmarks.procs import timestamp

RESULTS_DIR = Path(__file__).resolve().parents[1] / "results"
DESCRIPTION = "A load generator for any OpenAI-compatible server (this gateway, vLLM's server, others)."


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", description=DESCRIPTION,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000/v1", help="OpenAI-compatible base URL (with /v1)")
    p.add_argument("--model", help="model name (default: the first of GET /models)")
    p.add_argument("--endpoint", choices=["chat", "completions"], default="chat")
    p.add_argument("--concurrency", type=int, nargs="+",
                   help="requests in flight (default 8); several levels: a sweep; with --request-rate: a cap (default none)")
    p.add_argument("--request-rate", type=float, help="Poisson arrivals per second instead (concurrency becomes a cap)")
    p.add_argument("--num-requests", type=int, default=64, help="requests per run (per concurrency level)")
    p.add_argument("--waves", type=int, help="at least WAVES x concurrency requests per level")
    p.add_argument("--duration", type=float, default=300.0, help="time limit of each run in seconds (0: none)")
    p.add_argument("--prompts", choices=["random", "shared-prefix", "multi-turn"], default="random")
    p.add_argument("--input-tokens", type=int, default=128, help="tokens per prompt (per user turn)")
    p.add_argument("--output-tokens", type=int, default=64, help="max_tokens of every request")
    p.add_argument("--prefix-tokens", type=int, default=512, help="shared-prefix: tokens of the common prefix")
    p.add_argument("--num-prefixes", type=int, default=1, help="shared-prefix: distinct prefixes")
    p.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation")
    p.add_argument("--unique-prompts", type=int, help="cycle through this many prompts (1: the same request again)")
    p.add_argument("--ignore-eos", action="store_true", help="send ignore_eos (vLLM): exactly --output-tokens tokens")
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (negative: server default)")
    p.add_argument("--no-stream", dest="stream", action="store_false", help="non-streaming requests (TTFT = e2e)")
    p.add_argument("--extra-body", type=json.loads, default={}, help="JSON object merged into every request body")
    p.add_argument("--api-key")
    p.add_argument("--count-header", action="append", default=None, help="response header whose values are counted (default x-cache)")
    p.add_argument("--tokenizer", choices=["auto", "server", "words"], default="auto",
                   help="count prompt tokens with the server's /tokenize (auto: when present) or as words")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=0, help="warm-up requests before each run (not measured)")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--output", type=Path, help="JSON results file (default benchmarks/results/loadgen-<time>.json)")
    p.add_argument("--plot", type=Path, help="PNG plot (default: next to the JSON when several levels are run)")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--save-requests", action="store_true", help="put every request's record in the JSON")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--ceiling-duration", type=float, default=2.0,
                   help="after each run: seconds of the same load against the instant endpoint (benchmarks.instant_endpoint), "
                        "the client's ceiling, reported beside the run")
    p.add_argument("--no-ceiling", dest="ceiling_duration", action="store_const", const=0.0,
                   help="skip the ceiling run")
    return p


def config_from(args: argparse.Namespace) -> LoadConfig:
    return LoadConfig(
        base_url=args.base_url,
        model=args.model,
        endpoint=args.endpoint,
        concurrency=args.concurrency[0] if args.concurrency else (None if args.request_rate else 8),
        request_rate=args.request_rate,
        num_requests=args.num_requests,
        duration_s=args.duration or None,
        prompts=args.prompts,
        input_tokens=args.input_tokens,
        output_tokens=args.output_tokens,
        prefix_tokens=args.prefix_tokens,
        num_prefixes=args.num_prefixes,
        turns=args.turns,
        unique_prompts=args.unique_prompts,
        ignore_eos=args.ignore_eos,
        temperature=None if args.temperature < 0 else args.temperature,
        stream=args.stream,
        extra_body=args.extra_body,
        api_key=args.api_key,
        count_headers=[h.lower() for h in (args.count_header or ["x-cache"])],
        tokenizer=args.tokenizer,
        seed=args.seed,
        warmup_requests=args.warmup,
        request_timeout_s=args.request_timeout,
        progress=args.progress and sys.stderr.isatty(),
        keep_records=args.save_requests,
        ceiling_s=args.ceiling_duration,
    )


def main(argv: list[str] | None = None) -> int:
    """Run, write the JSON (and the plot of a sweep); exit status 1 when a run completed nothing."""
    args = parser().parse_args(argv)
    config = config_from(args)
    results = _run(args, config)
    stamp = timestamp()
    output = args.output or RESULTS_DIR / f"loadgen-{stamp}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(_document(stamp, argv, config, results, args.save_requests), indent=2))
    print(f"results: {output}", file=sys.stderr)
    if not args.no_plot and (args.plot or len(results) > 1):
        plot = plot_sweep({"": results}, args.plot or output.with_suffix(".png"), title=args.base_url)
        if plot:
            print(f"plot: {plot}", file=sys.stderr)
    return 0 if all(r.completed for r in results) else 1


def _run(args: argparse.Namespace, config: LoadConfig) -> list[Result]:
    """One Poisson run at --request-rate, else a sweep of the --concurrency levels."""
    if args.request_rate:
        result = run_async(run_load(dataclasses.replace(config, label=f"rate={args.request_rate}")))
        print(format_result(result), file=sys.stderr)
        return [result]
    return run_async(run_sweep(config, args.concurrency or [8], args.waves))


def _document(stamp: str, argv: list[str] | None, config: LoadConfig, results: list[Result], records: bool) -> dict[str, Any]:
    """The JSON results file: the tool, when, the command line, the config and each run's result."""
    return {
        "tool": "benchmarks.loadgen",
        "started": stamp,
        "argv": sys.argv if argv is None else ["loadgen", *argv],
        "config": config.to_dict(),
        "results": [r.to_dict(records=records) for r in results],
    }
