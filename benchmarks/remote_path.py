"""The front-gateway path at the limit (issue 27): gateway versions (`--versions NAME=DIR`: a
checkout each, imported with `python -P` and PYTHONPATH=DIR) forwarding to the instant endpoint as a
remote model, taking turns with the mock alone (the floor under the latency each adds) and an A/A
slot (`<first>-aa`: the first version's process again). Per target and level: req/s, latency
p50/p99 and what the gateway adds to the mock's of the same round, its CPU per request; ratios to
the first version as median [smallest, largest] of the per-repetition ratios.

    .venv/bin/python -m benchmarks.remote_path --versions before=/tmp/before after=. --repeats 5
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import sys
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LoadConfig, run_load
from benchmarks.loadgen.client import make_client
from benchmarks.procs import RESULTS, Proc, log, md_table, num, paired, rotated, run_command

# the gateway as deployed but for the response cache (every request would be stored: not the remote path)
GATEWAY_ENV = {"GATEWAY_WARMUP": "false", "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_LOG_LEVEL": "info",
               "GATEWAY_LOG_FORMAT": "json"}
MODEL = "bare"
METRICS = ("req_s", "p50_ms", "p99_ms", "added_p50_ms", "added_p99_ms", "cpu_ms")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The front-gateway path: gateways forwarding to an instant upstream")
    p.add_argument("--versions", nargs="+", default=["current=."], help="NAME=DIR: a checkout of the gateway each")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests", type=int, default=2000, help="requests per run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream", action="store_true", help="streamed answers (16 chunks) instead of whole ones")
    p.add_argument("--pause", type=float, default=0.5, help="seconds of quiet before each run")
    p.add_argument("--no-aa", action="store_true", help="no A/A slot")
    return p.parse_args(argv)


def gateway(name: str, directory: Path, upstream: str, logs: Path) -> Proc:
    """A gateway of the checkout in `directory` whose one model is a remote one at `upstream`."""
    models = logs / f"models-{name}.yaml"
    models.write_text(f"models:\n  - {{name: {MODEL}, kind: remote, url: '{upstream}', upstream_model: {MODEL}}}\n")
    command = [sys.executable, "-P", "-m", "gateway", "serve", "--models-file", str(models)]
    return Proc.on_free_port(name, command, {**GATEWAY_ENV, "PYTHONPATH": str(directory.resolve())}, logs)


async def work(args: argparse.Namespace, document: dict[str, Any]) -> None:
    logs = Path(document["logs"])
    mock = await Proc.on_free_port("mock", [sys.executable, "-m", "benchmarks.instant_endpoint", "--name", MODEL], {},
                                   logs).launch(60)
    versions = [spec.split("=", 1) for spec in args.versions]
    servers = {name: gateway(name, Path(directory), mock.base_url, logs) for name, directory in versions}
    await asyncio.gather(*(server.launch(120) for server in servers.values()))
    slots: list[tuple[str, Proc]] = [("mock", mock), *servers.items()]
    if not args.no_aa:
        slots.append((f"{versions[0][0]}-aa", servers[versions[0][0]]))
    document["targets"] = [name for name, _ in slots]
    runs: list[dict[str, Any]] = document.setdefault("runs", [])
    async with make_client(LoadConfig()) as client:
        for repeat in range(args.repeats):
            for i, level in enumerate(args.concurrency):
                mock_run: dict[str, Any] = {}
                for name, proc in rotated(slots, repeat * len(args.concurrency) + i):
                    await asyncio.sleep(args.pause)
                    config = LoadConfig(base_url=proc.base_url, model=MODEL, concurrency=level, num_requests=args.requests,
                                        duration_s=120, input_tokens=64, output_tokens=16, tokenizer="words",
                                        stream=args.stream, seed=repeat * 1000 + level)
                    warm = dataclasses.replace(config, num_requests=max(100, 4 * level), seed=config.seed + 7919)
                    await run_load(warm, client=client)  # untimed: connections opened, pools filled
                    cpu = None if proc is mock else proc.cpu_seconds(front_only=True)
                    result = await run_load(config, client=client)
                    spent = None if proc is mock else proc.cpu_seconds(front_only=True)
                    metrics = {"req_s": result.request_throughput, "p50_ms": result.e2e.p50 * 1e3,
                               "p99_ms": result.e2e.p99 * 1e3, "failed": result.failed,
                               "cpu_ms": None if cpu is None or spent is None
                               else (spent - cpu) / (result.completed + result.failed) * 1e3}
                    runs.append({"repeat": repeat, "concurrency": level, "target": name, "metrics": metrics})
                    log(f"r{repeat} c={level} {name}: {metrics['req_s']:.0f} req/s, p50 {metrics['p50_ms']:.2f} ms, "
                        f"p99 {metrics['p99_ms']:.2f} ms, {num(metrics['cpu_ms'], 2)} ms CPU/request, {result.failed} failed")
                    mock_run = metrics if proc is mock else mock_run
                # what each gateway adds to the mock's latency of this round (the mock's slot may come after theirs)
                for run in runs[-len(slots):]:
                    run["metrics"].update(added_p50_ms=run["metrics"]["p50_ms"] - mock_run["p50_ms"],
                                          added_p99_ms=run["metrics"]["p99_ms"] - mock_run["p99_ms"])


def summarize(document: dict[str, Any]) -> None:
    """Medians per target and level, the range of req/s, and every version's ratios to the first's."""
    runs, targets = document.get("runs", []), document.get("targets", [])
    document["summary"], document["ratios"] = [], []
    gateways = [t for t in targets if t != "mock"]
    for level in sorted({run["concurrency"] for run in runs}):
        medians = paired(runs, level, "mock", METRICS)["medians"]
        for target in (t for t in targets if t in medians):
            rates = [r["metrics"]["req_s"] for r in runs if r["concurrency"] == level and r["target"] == target]
            document["summary"].append({"level": level, "target": target, **medians[target], "req_s_range": [min(rates), max(rates)]})
        for target in gateways[1:]:
            row = paired(runs, level, target, ("req_s", "cpu_ms"))
            for key in ("req_s", "cpu_ms"):
                if (value := row["ratios"].get(gateways[0], {}).get(key)) is not None:
                    low, high = row["spread"][gateways[0]][key]
                    document["ratios"].append({"level": level, "ratio": f"{target} ÷ {gateways[0]}", "of": key,
                                               "median": value, "min": low, "max": high})


def render(document: dict[str, Any]) -> str:
    rows = [(r["level"], r["target"], f"{r['req_s']:.0f} [{r['req_s_range'][0]:.0f}-{r['req_s_range'][1]:.0f}]",
             num(r["p50_ms"], 2), num(r["p99_ms"], 2), *(("", "") if r["target"] == "mock" else
                                                          (num(r["added_p50_ms"], 2), num(r["added_p99_ms"], 2))),
             "" if r["cpu_ms"] is None else num(r["cpu_ms"], 2)) for r in document.get("summary", [])]
    ratios = [(r["level"], r["ratio"], r["of"], f"{r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]")
              for r in document.get("ratios", [])]
    return "\n".join([f"`{document['command']}`", "",
                      *md_table("c | target | req/s median [range] | p50 ms | p99 ms | added p50 ms | added p99 ms | "
                                "gateway CPU ms/request", rows, left=("target",)),
                      "", *md_table("c | ratio | of | median [smallest, largest]", ratios, left=("ratio", "of"))])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("remote_path", argv, parse(argv), work, render, RESULTS, finish=summarize)[0]


if __name__ == "__main__":
    sys.exit(main())
