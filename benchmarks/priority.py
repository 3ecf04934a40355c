"""Priority under a flood (#28 item 2): the time to first token of interactive requests at c=1
(normal class) with nothing else running, beside a flood of 64 low-priority streams, and beside the
same flood at the interactive requests' own class (what the gateway did without priorities), on the
real CPU engine. The scenarios run side by side in one gateway, repeated in rounds; each round
measures "alone" twice (an A/A pair: the noise floor of the ratios).

    .venv/bin/python -m benchmarks.priority --rounds 3 --probes 8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.procs import RESULTS, STARTED, Proc, free_port, log, timestamp

MODEL = "smollm2-135m-instruct"
KEYS = """
keys:
  interactive: {key: sk-interactive}
  batch-low: {key: sk-low, priority: low}
  batch-normal: {key: sk-normal}
"""
SCENARIOS = ("alone", "flood-low", "flood-normal", "alone-again")


async def ttft(client: httpx.AsyncClient, key: str, tokens: int, text: str, extra: dict[str, Any]) -> float:
    body = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
            "temperature": 0, "stream": True, **extra}
    started = time.perf_counter()
    first = None
    async with client.stream("POST", "/chat/completions", json=body, headers={"authorization": f"Bearer {key}"}) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - started
    assert first is not None
    return first


async def flood(client: httpx.AsyncClient, key: str, args: argparse.Namespace, stop: asyncio.Event) -> int:
    served = 0
    while not stop.is_set():
        try:
            await ttft(client, key, args.flood_tokens, f"Tell a long story, number {served}.", {"ignore_eos": True})
            served += 1
        except (httpx.HTTPError, AssertionError):
            await asyncio.sleep(0.5)  # refused (429) or cut: try again
    return served


async def scenario(client: httpx.AsyncClient, name: str, args: argparse.Namespace, round_no: int) -> list[float]:
    stop = asyncio.Event()
    key = {"flood-low": "sk-low", "flood-normal": "sk-normal"}.get(name)
    workers = [asyncio.create_task(flood(client, key, args, stop)) for _ in range(args.flood)] if key else []
    if workers:
        await asyncio.sleep(args.settle_s)  # the flood's requests admitted and generating
    times = []
    for i in range(args.probes):
        times.append(await ttft(client, "sk-interactive", args.probe_tokens,
                                f"Round {round_no}, {name}, question {i}: what is the capital of France?", {}))
    stop.set()
    for worker in workers:
        worker.cancel()  # the client leaves: its engine request is aborted
    await asyncio.gather(*workers, return_exceptions=True)
    await asyncio.sleep(args.settle_s if workers else 0)
    log(f"round {round_no} {name}: median TTFT {statistics.median(times) * 1000:.0f} ms")
    return times


async def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    (folder / "keys.yaml").write_text(KEYS)
    env = {"GATEWAY_KEYS_FILE": str(folder / "keys.yaml"), "GATEWAY_CACHE__BACKEND": "off",
           "GATEWAY_ADMISSION__MAX_RUNNING": str(args.max_running), "GATEWAY_ADMISSION__MAX_WAITING": "1024",
           "GATEWAY_ADMISSION__WAIT_TIMEOUT_S": "600", "GATEWAY_LOG_LEVEL": "warning",
           "GATEWAY_RATE_LIMIT_RPM": "1000000", "GATEWAY_ENGINE__ENFORCE_EAGER": str(args.eager).lower()}
    port = free_port()
    gateway = Proc("gateway", [sys.executable, "-m", "gateway", "serve", "--port", str(port)], env,
                   folder / "gateway.log", port, api_key="sk-interactive")
    gateway.start()
    try:
        await gateway.wait_ready(900)
        limits = httpx.Limits(max_connections=args.flood + 8)
        async with httpx.AsyncClient(base_url=gateway.base_url, timeout=900, limits=limits) as client:
            await ttft(client, "sk-interactive", 4, "warm up", {})
            rounds = []
            for r in range(args.rounds):
                rounds.append({name: await scenario(client, name, args, r) for name in SCENARIOS})
    finally:
        gateway.stop()
    return {"rounds": rounds}


def summary(rounds: list[dict[str, list[float]]]) -> dict[str, Any]:
    med = [{name: statistics.median(times) for name, times in r.items()} for r in rounds]
    ratios = {
        "flood-low / alone": [m["flood-low"] / m["alone"] for m in med],
        "flood-normal / alone": [m["flood-normal"] / m["alone"] for m in med],
        "alone-again / alone (A/A)": [m["alone-again"] / m["alone"] for m in med],
    }
    return {"median_ttft_s": med, "ratios": ratios}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--probes", type=int, default=8, help="interactive requests per scenario, one at a time")
    parser.add_argument("--probe-tokens", type=int, default=16)
    parser.add_argument("--flood", type=int, default=64, help="low-priority streams in flight")
    parser.add_argument("--flood-tokens", type=int, default=128)
    parser.add_argument("--max-running", type=int, default=32, help="admission max_running (docs: a CPU's bound)")
    parser.add_argument("--settle-s", type=float, default=5)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    folder = RESULTS / f"priority-{timestamp()}"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result = asyncio.run(run(args, folder))
    finally:
        for proc in STARTED:
            proc.stop()
    result.update(summary(result["rounds"]), args=vars(args))
    (folder / "priority.json").write_text(json.dumps(result, indent=2))
    print("| round | alone | flood-low | flood-normal | alone-again |\n|---|---|---|---|---|")
    for i, m in enumerate(result["median_ttft_s"]):
        print(f"| {i} | " + " | ".join(f"{m[name] * 1000:.0f} ms" for name in SCENARIOS) + " |")
    for name, values in result["ratios"].items():
        print(f"{name}: " + ", ".join(f"{v:.2f}" for v in values) + f" (median {statistics.median(values):.2f})")
    log(f"written to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
