"""How the gateway's cost grows with the work: prompt length, open idle streams, cached entries and
memory over a soak (benchmarks/README.md, "Growth"), with a markdown table per part."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import loadgen, procs
from benchmarks.loadgen import LoadConfig, Result
from benchmarks.loadgen.results import Stats
from benchmarks.procs import Proc, log, md_table, num

PARTS = ("prompt", "streams", "cache", "soak")
SMALL = {"lengths": [128, 512, 1024], "streams": 200, "cache_entries": 2000, "soak_requests": 20000}
FULL = {"lengths": [128, 256, 512, 1024, 2048, 4096], "streams": 1000, "cache_entries": 10000, "soak_requests": 100000}
MODEL = "growth"
STREAM_TOKEN_DELAY_S, STREAM_TOKENS, STREAM_RAMP_S = 1.0, 15, 4.0  # a held stream: one token a second for 15 s
CACHE_ANSWER_TOKENS, HIT_REQUESTS = 64, 300  # tokens per cached answer; hits timed, one at a time
SOAK_CACHE_ENTRIES = 10_000  # the soak's cache bound (the gateway's default)
QUIET = {"GATEWAY_WARMUP": "false", "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_CACHE__BACKEND": "off"}
MIB = 2**20


async def start_server(name: str, logs: Path, env: dict[str, str], *extra: str, real: bool = False, eager: bool = False) -> Proc:
    if real:
        command = [sys.executable, "-m", "gateway", "serve", "--served-model-name", MODEL, "--max-model-len", "8192",
                   *(["--enforce-eager"] if eager else [])]
    else:
        command = [sys.executable, "-m", "benchmarks.echo_engine", "--name", MODEL, *extra]
    return await Proc.on_free_port(name, command, env, logs).launch(900 if real else 120)


def config(server: Proc, **kwargs: Any) -> LoadConfig:
    base: dict[str, Any] = dict(base_url=server.base_url, model=MODEL, endpoint="completions", temperature=0.0,
                                ignore_eos=True, tokenizer="words", duration_s=600.0, request_timeout_s=600.0)
    return LoadConfig(**{**base, **kwargs})


def summary(result: Result) -> dict[str, Any]:
    return {**loadgen.metrics_of(result.to_dict()), "x_cache": result.header_counts.get("x-cache", {}),
            "client_cpu_share": result.client_cpu_share}


async def part_prompt(args: argparse.Namespace, logs: Path) -> list[dict[str, Any]]:
    real = args.engine == "real"
    server = await start_server("prompt", logs, QUIET, real=real, eager=args.eager)
    rows = []
    for length in args.lengths:
        for mode in ("random", "shared-prefix"):
            shared = mode == "shared-prefix"
            cfg = config(server, prompts=mode, input_tokens=32 if shared else length, prefix_tokens=max(1, length - 32),
                         concurrency=4, num_requests=32 if real else 500, output_tokens=16, stream=True,
                         tokenizer="auto", warmup_requests=2, seed=length)
            cpu = server.cpu_seconds(front_only=True) or 0.0
            result = await loadgen.run_load(cfg)
            cpu_ms = ((server.cpu_seconds(front_only=True) or 0.0) - cpu) * 1000 / max(1, result.completed)
            rows.append({"tokens": length, "prompts": mode, "mean_input_tokens": result.mean_input_tokens,
                         "gateway_cpu_ms_per_request": round(cpu_ms, 3), **summary(result)})
            log(f"prompt {length:5d} {mode:13s}: TTFT p50 {num(rows[-1]['ttft_p50_ms'], 2)} ms, e2e p50 "
                f"{num(rows[-1]['e2e_p50_ms'], 2)} ms, gateway CPU {cpu_ms:.3f} ms/request")
    server.stop()
    return rows


def rss(proc: Proc) -> int:
    return proc.rss(front_only=True) or 0


async def _sample(server: Proc, client: httpx.AsyncClient) -> dict[str, Any]:
    """The gateway's RSS and the latency of GET /health, as a client sees it."""
    started = time.perf_counter()
    await client.get(f"http://127.0.0.1:{server.port}/health")
    return {"t": time.perf_counter(), "health_ms": (time.perf_counter() - started) * 1000, "rss": rss(server)}


async def _lag(server: Proc) -> dict[str, Any]:
    async with httpx.AsyncClient() as client:
        return dict((await client.get(f"http://127.0.0.1:{server.port}/_bench/lag")).json())


async def part_streams(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    n, delay, tokens, ramp = args.streams, STREAM_TOKEN_DELAY_S, STREAM_TOKENS, STREAM_RAMP_S
    env = {**QUIET, "GATEWAY_ADMISSION__MAX_RUNNING": str(n + 100), "GATEWAY_ADMISSION__MAX_WAITING": str(n + 100)}
    server = await start_server("streams", logs, env, "--token-delay", str(delay), "--lag-probe")
    await loadgen.run_load(config(server, concurrency=4, num_requests=8, output_tokens=2, stream=True))
    await asyncio.sleep(1)
    base, idle_lag = rss(server), await _lag(server)
    async with httpx.AsyncClient() as client, procs.sampling(0.25, lambda: _sample(server, client)) as samples:
        started = time.perf_counter()
        load = asyncio.create_task(loadgen.run_load(config(server, concurrency=n, num_requests=n, output_tokens=tokens,
                                                           input_tokens=16, stream=True)))
        await asyncio.sleep(ramp)
        await _lag(server)  # from here on: all streams open
        await asyncio.sleep(max(0.5, tokens * delay - ramp - 2 * delay))
        held_lag, held_until = await _lag(server), time.perf_counter()
        result = await load
    server.stop()
    held = [s for s in samples if started + ramp <= s["t"] <= held_until] or samples
    peak, health = max(s["rss"] for s in held), Stats.of([s["health_ms"] for s in held])
    return {"streams": n, "token_delay_s": delay, "tokens": tokens, "rss_before_mib": base / MIB, "rss_held_mib": peak / MIB,
            "kib_per_stream": (peak - base) / n / 1024, "loop_lag_idle": idle_lag, "loop_lag_held": held_lag,
            "health_p50_ms": health.p50, "health_p99_ms": health.p99, "health_max_ms": health.max, "load": summary(result)}


async def part_cache(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    n = args.cache_entries
    env = {**QUIET, "GATEWAY_CACHE__BACKEND": "memory", "GATEWAY_CACHE__MAX_ENTRIES": str(n + 1000),
           "GATEWAY_CACHE__MAX_BYTES": str(4 * 2**30)}
    server = await start_server("cache", logs, env)
    fill = config(server, concurrency=16, num_requests=n, output_tokens=CACHE_ANSWER_TOKENS, stream=False, input_tokens=128, seed=1)
    few = dataclasses.replace(fill, num_requests=10, seed=2)
    hits = dataclasses.replace(fill, concurrency=1, num_requests=HIT_REQUESTS)  # one at a time, answers cached before
    few_sessions, sessions = await loadgen.build_sessions(few, 10, None), await loadgen.build_sessions(fill, n, None)
    await loadgen.run_load(few, sessions=few_sessions)
    small = await loadgen.run_load(hits, sessions=few_sessions)
    await asyncio.sleep(1)
    before, filled = rss(server), await loadgen.run_load(fill, sessions=sessions)
    await asyncio.sleep(1)
    after, full = rss(server), await loadgen.run_load(hits, sessions=sessions[:HIT_REQUESTS])
    server.stop()
    return {"entries": n, "answer_tokens": CACHE_ANSWER_TOKENS, "rss_before_mib": before / MIB, "rss_after_mib": after / MIB,
            "bytes_per_entry": (after - before) / n, "fill": summary(filled), "hit_nearly_empty": summary(small),
            "hit_full": summary(full)}


async def part_soak(args: argparse.Namespace, logs: Path) -> dict[str, Any]:
    total, bound_entries = args.soak_requests, SOAK_CACHE_ENTRIES
    env = {**QUIET, "GATEWAY_CACHE__BACKEND": "memory", "GATEWAY_CACHE__MAX_ENTRIES": str(bound_entries),
           "GATEWAY_LOG_LEVEL": "info", "GATEWAY_LOG_FORMAT": "json"}
    server = await start_server("soak", logs, env)
    points: list[dict[str, Any]] = [{"requests": 0, "rss_mib": rss(server) / MIB}]
    failed, step = 0, max(1, total // 20)
    async with loadgen.make_client(config(server)) as client:
        for i, done in enumerate(range(step, total + 1, step)):
            cfg = config(server, concurrency=16, num_requests=step, output_tokens=16, stream=i % 2 == 1, input_tokens=64, seed=1000 + i)
            result = await loadgen.run_load(cfg, client=client)
            failed += result.failed + result.cancelled
            points.append({"requests": done, "rss_mib": rss(server) / MIB, "req_s": result.request_throughput})
            log(f"soak: {done} requests, RSS {points[-1]['rss_mib']:.1f} MiB, {result.request_throughput:.0f} req/s")
    server.stop()
    bound = next((p for p in points if p["requests"] >= bound_entries), None)  # every request a new entry
    return {"requests": total, "failed": failed, "points": points, "cache_bound_entries": bound_entries,
            "rss_at_bound_mib": bound and bound["rss_mib"], "rss_end_mib": points[-1]["rss_mib"],
            "growth_after_bound_mib": bound and points[-1]["rss_mib"] - bound["rss_mib"]}


def _slash(stats: dict[str, Any], *keys: str, digits: int = 2) -> str:
    return " / ".join(num(stats.get(k), digits) for k in keys)


def _prompt(rows: list[dict[str, Any]]) -> list[str]:
    return md_table("prompt tokens | prompts | mean input tokens | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | req/s | "
                    "gateway CPU ms/request | failed",
                    [[r["tokens"], r["prompts"], num(r["mean_input_tokens"]), num(r["ttft_p50_ms"], 2), num(r["ttft_p99_ms"], 2),
                      num(r["e2e_p50_ms"], 2), num(r["req_s"]), num(r["gateway_cpu_ms_per_request"], 3), r["failed"]]
                     for r in rows], left=("prompts",))


def _streams(s: dict[str, Any]) -> list[str]:
    return md_table("streams held | RSS before MiB | RSS held MiB | KiB per open stream | loop lag idle p99 / max ms | "
                    "loop lag held p50 / p99 / max ms | GET /health p50 / p99 / max ms | failed",
                    [[s["streams"], num(s["rss_before_mib"]), num(s["rss_held_mib"]), num(s["kib_per_stream"]),
                      _slash(s["loop_lag_idle"], "p99_ms", "max_ms"), _slash(s["loop_lag_held"], "p50_ms", "p99_ms", "max_ms"),
                      _slash(s, "health_p50_ms", "health_p99_ms", "health_max_ms"), s["load"]["failed"]]])


def _cache(c: dict[str, Any]) -> list[str]:
    return md_table("entries | tokens per answer | RSS before MiB | RSS after MiB | bytes per entry | "
                    "hit e2e p50 / p99 ms, 10 entries | hit e2e p50 / p99 ms, full | hits counted",
                    [[c["entries"], c["answer_tokens"], num(c["rss_before_mib"]), num(c["rss_after_mib"]),
                      num(c["bytes_per_entry"], 0), _slash(c["hit_nearly_empty"], "e2e_p50_ms", "e2e_p99_ms", digits=3),
                      _slash(c["hit_full"], "e2e_p50_ms", "e2e_p99_ms", digits=3), c["hit_full"]["x_cache"]]],
                    left=("hits counted",))


def _soak(s: dict[str, Any]) -> list[str]:
    points = ", ".join(f"{p['requests']}: {p['rss_mib']:.0f}" for p in s["points"])
    bound = s["cache_bound_entries"]
    return [f"- {s['requests']} requests ({s['failed']} failed); RSS (MiB) after each step: {points}",
            f"- the cache's bound ({bound} entries) was not reached: growth after it not measured"
            if s.get("rss_at_bound_mib") is None else
            f"- RSS when the cache reached its bound ({bound} entries): {s['rss_at_bound_mib']:.1f} MiB; at the end: "
            f"{s['rss_end_mib']:.1f} MiB; growth after the bound: {s['growth_after_bound_mib']:+.1f} MiB"]


def markdown(document: dict[str, Any]) -> str:
    lines = [f"Growth ({document['started']}): `{document['command']}`", ""]
    for key, title, render in (("prompt", "Cost against prompt length", _prompt), ("streams", "Open idle streams", _streams),
                               ("cache", "Cached entries", _cache), ("soak", "Memory over many requests (echo engine)", _soak)):
        if document.get(key):
            lines += [f"### {title}", "", *render(document[key]), ""]
    if document.get("error"):
        lines.append(f"INCOMPLETE: {document['error']}")
    return "\n".join(lines) + "\n"


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="How the gateway's cost grows with the work",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS))
    p.add_argument("--full", action="store_true", help="the full sizes: " + json.dumps(FULL))
    p.add_argument("--engine", choices=["echo", "real"], default="echo", help="the prompt part's engine")
    p.add_argument("--eager", action="store_true", help="--engine real: --enforce-eager (quick start)")
    p.add_argument("--lengths", type=int, nargs="+", help=f"prompt lengths in tokens (default {SMALL['lengths']})")
    p.add_argument("--streams", type=int, help=f"streams held open (default {SMALL['streams']})")
    p.add_argument("--cache-entries", type=int, help=f"distinct cached answers (default {SMALL['cache_entries']})")
    p.add_argument("--soak-requests", type=int, help=f"requests of the soak (default {SMALL['soak_requests']})")
    return p


async def run(args: argparse.Namespace, document: dict[str, Any]) -> None:
    parts = {"prompt": part_prompt, "streams": part_streams, "cache": part_cache, "soak": part_soak}
    for name in args.parts:
        log(f"growth: {name}")
        document[name] = await parts[name](args, Path(document["logs"]))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    for key, value in (FULL if args.full else SMALL).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    return procs.run_command("growth", argv, args, run, markdown)[0]


if __name__ == "__main__":
    sys.exit(main())
