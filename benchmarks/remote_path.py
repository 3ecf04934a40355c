"""The front-gateway path at the limit (issue 27): gateways forwarding to an instant upstream.

One instant endpoint (`benchmarks.instant_endpoint`) is the upstream of every gateway started here,
each a version of the code (`--versions NAME=DIR`: a checkout, imported with `python -P` and
PYTHONPATH=DIR, so `git worktree add /tmp/before <commit>` measures an older commit) whose models
file has one remote model pointing at it. The targets take turns, who goes first rotating, at each
concurrency level of each repetition: `mock` (the instant endpoint alone, the floor under the
latency each gateway adds), each version, and `<first>-aa`, the first version's very process
measured once more in its own slot (A/A: the noise floor of every ratio). Non-streamed chat
completions (`--stream` for streams) of 64 words and 16 output tokens, every request new.

Per target and level: req/s, latency p50/p99 and what the gateway adds to the mock's of the same
round, and the gateway process's CPU per request (psutil, user + system, over the measured run).
Ratios of each version to the first (and of the A/A) are the median [smallest, largest] of the
per-repetition ratios.

    .venv/bin/python -m benchmarks.remote_path --versions before=/tmp/before after=. --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LoadConfig, run_load
from benchmarks.loadgen.client import make_client
from benchmarks.procs import RESULTS, Proc, free_port, log, md_table, run_command

# the gateway as deployed but for the response cache (every request would be stored: not the remote path)
GATEWAY_ENV = {"GATEWAY_WARMUP": "false", "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_LOG_LEVEL": "info",
               "GATEWAY_LOG_FORMAT": "json"}
MODEL = "bare"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--versions", nargs="+", default=["current=."], help="NAME=DIR: a checkout of the gateway each")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests", type=int, default=2000, help="requests per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream", action="store_true", help="streamed answers (16 chunks) instead of whole ones")
    p.add_argument("--pause", type=float, default=0.5, help="seconds of quiet before each run")
    p.add_argument("--no-aa", action="store_true", help="no A/A slot")
    return p.parse_args(argv)


def gateway(name: str, directory: Path, upstream: str, logs: Path) -> Proc:
    models = logs / f"models-{name}.yaml"
    models.write_text(f"models:\n  - {{name: {MODEL}, kind: remote, url: '{upstream}', upstream_model: {MODEL}}}\n")
    port = free_port()
    command = [sys.executable, "-P", "-m", "gateway", "serve", "--port", str(port), "--models-file", str(models)]
    return Proc(name, command, {**GATEWAY_ENV, "PYTHONPATH": str(directory.resolve())}, logs / f"{name}.log", port=port)


async def work(args: argparse.Namespace, document: dict[str, Any]) -> None:
    logs = Path(document["logs"])
    port = free_port()
    mock = Proc("mock", [sys.executable, "-m", "benchmarks.instant_endpoint", "--port", str(port), "--name", MODEL],
                {}, logs / "mock.log", port=port)
    mock.start()
    await mock.wait_ready(60)
    versions = [spec.split("=", 1) for spec in args.versions]
    servers = {name: gateway(name, Path(directory), mock.base_url, logs) for name, directory in versions}
    for server in servers.values():
        server.start()
    for server in servers.values():
        await server.wait_ready(120)
    first = versions[0][0]
    slots: list[tuple[str, Proc]] = [("mock", mock), *servers.items()]
    if not args.no_aa:
        slots.append((f"{first}-aa", servers[first]))
    document["targets"] = [name for name, _ in slots]
    runs: list[dict[str, Any]] = document.setdefault("runs", [])
    async with make_client(LoadConfig()) as client:
        for repeat in range(args.repeats):
            for level in args.concurrency:
                shift = (repeat * len(args.concurrency) + args.concurrency.index(level)) % len(slots)
                for name, proc in slots[shift:] + slots[:shift]:
                    await asyncio.sleep(args.pause)
                    config = LoadConfig(base_url=proc.base_url, model=MODEL, concurrency=level, num_requests=args.requests,
                                        duration_s=120, input_tokens=64, output_tokens=16, tokenizer="words",
                                        stream=args.stream, seed=repeat * 1000 + level)
                    warm = dataclasses.replace(config, num_requests=max(100, 4 * level), seed=config.seed + 7919)
                    await run_load(warm, client=client)  # untimed: connections opened, pools filled
                    gateway_proc = None if proc is mock else proc
                    cpu = gateway_proc.cpu_seconds(front_only=True) if gateway_proc else None
                    result = await run_load(config, client=client)
                    spent = gateway_proc.cpu_seconds(front_only=True) if gateway_proc else None
                    done = result.completed + result.failed
                    run = {"repeat": repeat, "level": level, "target": name, "req_s": result.request_throughput,
                           "p50_ms": result.e2e.p50 * 1e3, "p99_ms": result.e2e.p99 * 1e3, "failed": result.failed,
                           "cpu_ms": (spent - cpu) / done * 1e3 if cpu is not None and spent is not None else None}
                    runs.append(run)
                    log(f"r{repeat} c={level} {name}: {run['req_s']:.0f} req/s, p50 {run['p50_ms']:.2f} ms, "
                        f"p99 {run['p99_ms']:.2f} ms" + (f", {run['cpu_ms']:.2f} ms CPU/request" if run["cpu_ms"] else "")
                        + (f", {result.failed} failed" if result.failed else ""))


def summarize(document: dict[str, Any]) -> None:
    runs, targets = document.get("runs", []), document.get("targets", [])
    levels = sorted({run["level"] for run in runs})
    rows, ratios = [], []
    for level in levels:
        at = [run for run in runs if run["level"] == level]
        mock = {run["repeat"]: run for run in at if run["target"] == "mock"}
        for target in targets:
            mine = [run for run in at if run["target"] == target]
            if not mine:
                continue
            added = [(run["p50_ms"] - mock[run["repeat"]]["p50_ms"], run["p99_ms"] - mock[run["repeat"]]["p99_ms"])
                     for run in mine if run["repeat"] in mock]
            cpu = [run["cpu_ms"] for run in mine if run["cpu_ms"] is not None]
            rows.append({"level": level, "target": target, "req_s": _median([r["req_s"] for r in mine]),
                         "p50_ms": _median([r["p50_ms"] for r in mine]), "p99_ms": _median([r["p99_ms"] for r in mine]),
                         "added_p50_ms": _median([a[0] for a in added]), "added_p99_ms": _median([a[1] for a in added]),
                         "cpu_ms": _median(cpu) if cpu else None, "req_s_range": [min(r["req_s"] for r in mine), max(r["req_s"] for r in mine)]})
        gateways = [t for t in targets if t != "mock"]
        if not gateways:
            continue
        base = gateways[0]
        by = {(run["target"], run["repeat"]): run for run in at}
        for target in gateways[1:]:
            for key in ("req_s", "cpu_ms"):
                values = [by[(target, r)][key] / by[(base, r)][key] for (t, r) in by
                          if t == target and (base, r) in by and by[(target, r)][key] and by[(base, r)][key]]
                if values:
                    ratios.append({"level": level, "ratio": f"{target} ÷ {base}", "of": key, "median": _median(values),
                                   "min": min(values), "max": max(values)})
    document["summary"] = rows
    document["ratios"] = ratios


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def render(document: dict[str, Any]) -> str:
    lines = [f"`{document['command']}`", ""]
    rows = [(r["level"], r["target"], f"{r['req_s']:.0f} [{r['req_s_range'][0]:.0f}-{r['req_s_range'][1]:.0f}]",
             f"{r['p50_ms']:.2f}", f"{r['p99_ms']:.2f}",
             "" if r["target"] == "mock" else f"{r['added_p50_ms']:.2f}", "" if r["target"] == "mock" else f"{r['added_p99_ms']:.2f}",
             "" if r["cpu_ms"] is None else f"{r['cpu_ms']:.2f}") for r in document.get("summary", [])]
    lines += md_table("c | target | req/s median [range] | p50 ms | p99 ms | added p50 ms | added p99 ms | gateway CPU ms/request",
                      rows, left=("target",))
    lines += ["", *md_table("c | ratio | of | median [smallest, largest]",
                            [(r["level"], r["ratio"], r["of"], f"{r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]")
                             for r in document.get("ratios", [])], left=("ratio", "of"))]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    started = time.monotonic()
    code, _, _ = run_command("remote_path", argv, parse(argv), work, render, RESULTS, finish=summarize)
    log(f"took {time.monotonic() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
