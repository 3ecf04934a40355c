"""The batch lane (issue 29), on the real CPU engine, in one gateway:

1. interactive latency: streamed chat requests, `--probe-concurrency` in flight (64-token answers),
   their time to first token p50/p99 on an idle engine ("idle"), while a batch of `--lines` lines
   runs ("batch"; cancelled once the probes are done) and on the idle engine again ("idle-again":
   the A/A pair, the noise floor of the ratios);
2. batch throughput: `--throughput-lines` requests run as a batch on an otherwise idle engine (from
   create to `completed`: lines/s and output tokens/s) against the same requests sent as a plain
   load test at `batches.max_in_flight` in flight.

Every request asks for exactly `--tokens` tokens (`ignore_eos`), at temperature 0, each one new
(no cache). The scenarios take turns within each round; the table holds medians over the rounds.

    .venv/bin/python -m benchmarks.batch_lane --rounds 2
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

from benchmarks.loadgen.results import percentile
from benchmarks.procs import RESULTS, STARTED, Proc, free_port, log, md_table, timestamp

MODEL = "smollm2-135m-instruct"
KEY = "sk-bench"
LATENCY = ("idle", "batch", "idle-again")
HEADERS = {"authorization": f"Bearer {KEY}"}


def chat_body(text: str, tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": MODEL, "messages": [{"role": "user", "content": text}], "max_tokens": tokens,
                            "temperature": 0, "ignore_eos": True}
    return {**body, "stream": True} if stream else body


async def ttft(client: httpx.AsyncClient, text: str, tokens: int) -> float:
    started = time.perf_counter()
    first = None
    async with client.stream("POST", "/chat/completions", json=chat_body(text, tokens, True)) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {") and '"content"' in line:
                first = time.perf_counter() - started
    assert first is not None
    return first


async def probes(client: httpx.AsyncClient, args: argparse.Namespace, tag: str) -> list[float]:
    """`--probes` streamed requests, `--probe-concurrency` at a time: their TTFTs."""
    queue = list(range(args.probes))
    times: list[float] = []

    async def worker() -> None:
        while queue:
            i = queue.pop()
            times.append(await ttft(client, f"{tag}, question {i}: tell me about the sea.", args.tokens))

    await asyncio.gather(*(worker() for _ in range(args.probe_concurrency)))
    return times


async def create_batch(client: httpx.AsyncClient, lines: int, tokens: int, tag: str) -> str:
    content = b"".join(json.dumps({
        "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": chat_body(f"{tag}, request {i}: write about the mountains.", tokens, False),
    }).encode() + b"\n" for i in range(lines))
    uploaded = await client.post("/files", files={"file": (f"{tag}.jsonl", content)}, data={"purpose": "batch"})
    uploaded.raise_for_status()
    created = await client.post("/batches", json={"input_file_id": uploaded.json()["id"],
                                                  "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    created.raise_for_status()
    return str(created.json()["id"])


async def wait_batch(client: httpx.AsyncClient, batch_id: str, until: frozenset[str], every_s: float = 0.2) -> dict[str, Any]:
    while True:
        batch: dict[str, Any] = (await client.get(f"/batches/{batch_id}")).json()
        if batch["status"] in until or batch["status"] == "failed":
            return batch
        await asyncio.sleep(every_s)


async def until_started(client: httpx.AsyncClient, batch_id: str) -> None:
    """Until the batch's first line is answered: its lines are in the engine."""
    for _ in range(3000):
        if (await client.get(f"/batches/{batch_id}")).json()["request_counts"]["completed"] >= 1:
            return
        await asyncio.sleep(0.2)
    raise RuntimeError(f"batch {batch_id} answered no line in 10 minutes")


async def latency_scenario(client: httpx.AsyncClient, name: str, args: argparse.Namespace, round_no: int) -> list[float]:
    batch_id = None
    if name == "batch":
        batch_id = await create_batch(client, args.lines, args.tokens, f"r{round_no}-lane")
        await until_started(client, batch_id)
    times = await probes(client, args, f"round {round_no}, {name}")
    if batch_id is not None:
        await client.post(f"/batches/{batch_id}/cancel")  # a 400 when it is done already
        done = await wait_batch(client, batch_id, frozenset({"cancelled", "completed"}))
        log(f"round {round_no} batch: {done['request_counts']['completed']} lines answered meanwhile, then {done['status']}")
        await asyncio.sleep(args.settle_s)
    log(f"round {round_no} {name}: TTFT p50 {statistics.median(times) * 1000:.0f} ms, p99 {percentile(times, 99) * 1000:.0f} ms")
    return times


async def batch_throughput(client: httpx.AsyncClient, args: argparse.Namespace, round_no: int) -> dict[str, float]:
    started = time.perf_counter()
    batch_id = await create_batch(client, args.throughput_lines, args.tokens, f"r{round_no}-throughput")
    batch = await wait_batch(client, batch_id, frozenset({"completed", "cancelled", "expired"}), every_s=0.1)
    took = time.perf_counter() - started
    counts = batch["request_counts"]
    if batch["status"] != "completed" or counts["failed"]:
        raise RuntimeError(f"the throughput batch did not complete cleanly: {batch}")
    return {"lines_s": counts["completed"] / took, "tokens_s": batch["usage"]["output_tokens"] / took, "s": took}


async def load_throughput(client: httpx.AsyncClient, args: argparse.Namespace, round_no: int) -> dict[str, float]:
    """The same requests as a plain load test: `--max-in-flight` at a time, non-streamed."""
    queue = list(range(args.throughput_lines))
    tokens = 0

    async def worker() -> None:
        nonlocal tokens
        while queue:
            i = queue.pop()
            body = chat_body(f"r{round_no}-load, request {i}: write about the mountains.", args.tokens, False)
            answer = await client.post("/chat/completions", json=body)
            answer.raise_for_status()
            tokens += answer.json()["usage"]["completion_tokens"]

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.max_in_flight)))
    took = time.perf_counter() - started
    return {"lines_s": args.throughput_lines / took, "tokens_s": tokens / took, "s": took}


async def one_round(client: httpx.AsyncClient, args: argparse.Namespace, r: int) -> dict[str, Any]:
    latency = {name: await latency_scenario(client, name, args, r) for name in LATENCY}
    arms = [("batch", batch_throughput), ("load", load_throughput)]
    throughput = {}
    for name, measure in arms if r % 2 == 0 else arms[::-1]:  # who goes first alternates
        throughput[name] = await measure(client, args, r)
        log(f"round {r} throughput {name}: {throughput[name]['lines_s']:.2f} lines/s, "
            f"{throughput[name]['tokens_s']:.0f} tok/s")
    return {"latency": latency, "throughput": throughput}


def gateway(args: argparse.Namespace, folder: Path) -> Proc:
    (folder / "keys.yaml").write_text(f"keys:\n  bench: {{key: {KEY}}}\n")
    env = {"GATEWAY_KEYS_FILE": str(folder / "keys.yaml"), "GATEWAY_CACHE__BACKEND": "off",
           "GATEWAY_FILES__DIR": str(folder / "files"), "GATEWAY_BATCHES__DIR": str(folder / "batches"),
           "GATEWAY_BATCHES__MAX_IN_FLIGHT": str(args.max_in_flight), "GATEWAY_BATCHES__POLL_S": "0.2",
           "GATEWAY_ADMISSION__MAX_RUNNING": str(args.max_running), "GATEWAY_ADMISSION__MAX_WAITING": "1024",
           "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_RATE_LIMIT_RPM": "1000000",
           "GATEWAY_ENGINE__ENFORCE_EAGER": str(args.eager).lower()}
    port = free_port()
    return Proc("gateway", [sys.executable, "-m", "gateway", "serve", "--port", str(port)], env,
                folder / "gateway.log", port, api_key=KEY)


async def run(args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    server = gateway(args, folder)
    server.start()
    try:
        await server.wait_ready(900)
        async with httpx.AsyncClient(base_url=server.base_url, timeout=900, headers=HEADERS) as client:
            await ttft(client, "warm up", 4)
            rounds = [await one_round(client, args, r) for r in range(args.rounds)]
    finally:
        server.stop()
    return {"rounds": rounds}


def summary(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    latency = {name: {"p50_ms": med([percentile(r["latency"][name], 50) * 1000 for r in rounds]),
                      "p99_ms": med([percentile(r["latency"][name], 99) * 1000 for r in rounds])} for name in LATENCY}
    ratios = {f"{name} / idle": med([percentile(r["latency"][name], 50) / percentile(r["latency"]["idle"], 50)
                                     for r in rounds]) for name in LATENCY[1:]}
    throughput = {arm: {k: med([r["throughput"][arm][k] for r in rounds]) for k in ("lines_s", "tokens_s")}
                  for arm in ("batch", "load")}
    ratios["batch / load (tok/s)"] = med([r["throughput"]["batch"]["tokens_s"] / r["throughput"]["load"]["tokens_s"]
                                          for r in rounds])
    return {"latency": latency, "throughput": throughput, "ratios": ratios}


def table(result: dict[str, Any]) -> list[str]:
    lat, thr, ratios = result["latency"], result["throughput"], result["ratios"]
    rows = [[f"interactive TTFT, {name}", f"{lat[name]['p50_ms']:.0f} ms", f"{lat[name]['p99_ms']:.0f} ms",
             f"{ratios[name + ' / idle']:.2f}" if name != "idle" else "1.00"] for name in LATENCY]
    rows += [[f"throughput, {arm}", f"{thr[arm]['lines_s']:.2f} lines/s", f"{thr[arm]['tokens_s']:.0f} tok/s",
              f"{ratios['batch / load (tok/s)']:.2f}" if arm == "batch" else "1.00"] for arm in ("batch", "load")]
    return md_table("measure | p50 / lines/s | p99 / tok/s | ratio (median of rounds)", rows, left=["measure"])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--probes", type=int, default=12, help="interactive streamed requests per scenario")
    parser.add_argument("--probe-concurrency", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=64, help="answer length of every request")
    parser.add_argument("--lines", type=int, default=200, help="lines of the batch running beside the probes")
    parser.add_argument("--throughput-lines", type=int, default=24, help="requests of the throughput arms")
    parser.add_argument("--max-in-flight", type=int, default=4, help="batches.max_in_flight (and the load test's)")
    parser.add_argument("--max-running", type=int, default=32, help="admission max_running")
    parser.add_argument("--settle-s", type=float, default=2)
    parser.add_argument("--eager", action=argparse.BooleanOptionalAction, default=True)
    args = parser.parse_args(argv)
    folder = RESULTS / f"batch-lane-{timestamp()}"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        result = asyncio.run(run(args, folder))
    finally:
        for proc in STARTED:
            proc.stop()
    result.update(summary(result["rounds"]), args=vars(args))
    (folder / "batch_lane.json").write_text(json.dumps(result, indent=2))
    print("\n".join(table(result)))
    log(f"written to {folder}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
