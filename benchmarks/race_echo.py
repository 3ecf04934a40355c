"""The race's echo part: the gateway on the echo engine as deployed (`echo`, and `echo-aa`, the same
process again) against `bare` (benchmarks.bare_app), taking turns, per scenario (non-stream,
stream, cache hit; benchmarks/README.md) and level, each run followed by the client's ceiling.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path
from typing import Any

from benchmarks import loadgen
from benchmarks.loadgen import LoadConfig
from benchmarks.procs import Proc, free_port, log
from benchmarks.race_models import Again, Target
from benchmarks.race_report import SERVED_NAME, metrics_of, num
from benchmarks.race_servers import BENCH_KEY, ECHO_ENV, bare_command, echo_command

# name -> (streamed, cache hit)
SCENARIOS: dict[str, tuple[bool, bool]] = {
    "non-stream": (False, False),
    "stream": (True, False),
    "cache hit": (False, True),
    "cache hit, stream": (True, True),
}
ECHO_TARGETS = ("echo", "echo-aa", "bare")


def scenario_config(args: argparse.Namespace, scenario: str, base_url: str, level: int, seed: int, label: str) -> LoadConfig:
    stream, hit = SCENARIOS[scenario]
    return LoadConfig(
        base_url=base_url, model=SERVED_NAME, endpoint="completions", concurrency=level,
        num_requests=args.echo_requests, duration_s=args.run_timeout, input_tokens=args.input_tokens,
        output_tokens=args.output_tokens if stream else 1, ignore_eos=True, temperature=0.0, stream=stream,
        api_key=BENCH_KEY, tokenizer="words", seed=seed, unique_prompts=1 if hit else None,
        warmup_requests=1 if hit else min(2 * level, args.echo_requests), count_headers=["x-cache"],
        request_timeout_s=args.run_timeout, label=label, ceiling_s=args.ceiling_duration,
        http_client=args.echo_client,
    )


async def measure_echo(target: Target, args: argparse.Namespace, scenario: str, repeat: int, level: int, seed: int) -> dict[str, Any]:
    await asyncio.sleep(args.echo_pause)
    label = f"{target.name} {scenario} r{repeat} c{level}"
    cfg = scenario_config(args, scenario, target.base_url, level, seed, label)
    sessions = await loadgen.build_sessions(cfg, loadgen.sessions_needed(cfg), None, seed=seed)
    warm = await loadgen.build_sessions(cfg, 1, None, seed=seed) if SCENARIOS[scenario][1] else None
    result = await loadgen.run_load(cfg, sessions=sessions, warmup_sessions=warm)
    data = result.to_dict()
    metrics = metrics_of(data)
    metrics["e2e_p99_ms"] = None if data["e2e"]["p99"] is None else data["e2e"]["p99"] * 1000
    hits = result.header_counts.get("x-cache", {})
    log(f"{target.name:8s} {scenario:17s} r{repeat} c={level:<3d} {num(metrics['req_s'])} req/s, "
        f"{num(metrics['output_tok_s'])} tok/s, e2e p50 {num(metrics['e2e_p50_ms'], 2)} ms, failed {metrics['failed']}"
        + (f", client headroom {metrics['client_headroom']:.1f}x" if metrics.get("client_headroom") else "")
        + (f", X-Cache {hits}" if hits else ""))
    return {"target": target.name, "scenario": scenario, "repeat": repeat, "concurrency": level, "metrics": metrics,
            "x_cache": hits, "result": data}


async def run_echo(args: argparse.Namespace, logs: Path, document: dict[str, Any]) -> None:
    echo_port, bare_port = free_port(), free_port()
    echo = Proc("echo", echo_command(echo_port), ECHO_ENV, logs / "echo.log", port=echo_port, api_key=BENCH_KEY)
    bare = Proc("bare", bare_command(bare_port), {}, logs / "bare.log", port=bare_port)
    alive: list[Target] = [echo, bare]
    if args.aa:
        alive.insert(1, Again(echo, "echo-aa"))
    runs: list[dict[str, Any]] = document.setdefault("echo_runs", [])
    try:
        for server in (echo, bare):
            server.start()
        await asyncio.gather(echo.wait_ready(120), bare.wait_ready(60))
        for r in range(args.repeats):
            for s, scenario in enumerate(args.echo_scenarios):
                for i, level in enumerate(args.echo_concurrency):
                    shift = (r + s + i) % len(alive)  # who goes first rotates
                    for j, target in enumerate(alive[shift:] + alive[:shift]):
                        seed = args.seed + 10_000_000 * (r + 1) + 100_000 * s + 1000 * i + 10 * j  # fresh prompts every run
                        runs.append(await measure_echo(target, args, scenario, r, level, seed))
    finally:
        echo.stop()
        bare.stop()


def echo_options(p: argparse.ArgumentParser) -> None:
    """The echo part's flags on the race's parser."""
    p.add_argument("--echo-concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--echo-requests", type=int, default=2000, help="requests per echo-part run")
    p.add_argument("--echo-scenarios", nargs="+", choices=list(SCENARIOS), default=["non-stream", "stream", "cache hit"])
    p.add_argument("--echo-pause", type=float, default=0.5, help="seconds of quiet before each echo-part run")
    p.add_argument("--echo-client", choices=("wire", "aiohttp"), default="wire",
                   help="the echo part's HTTP client: wire (benchmarks.loadgen.wire, ~4x less CPU per request than "
                        "aiohttp, so that one process has 5x headroom over the bare app) or aiohttp")


def scenario_runs(runs: list[dict[str, Any]], scenario: str) -> list[dict[str, Any]]:
    """The runs of one scenario (each: target, scenario, repeat, concurrency, metrics, x_cache, result)."""
    return [r for r in runs if r["scenario"] == scenario]
