"""The design's deployment targets (TTFT p99 < 500 ms above 50 requests/s, memory <= 80%) on this
hardware (`make targets`; benchmarks/README.md, "The deployment targets"). Exit status 0 only when
all are met."""

from __future__ import annotations

import argparse
import asyncio
import math
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx

from benchmarks import loadgen, procs
from benchmarks.loadgen import LoadConfig, Result
from benchmarks.procs import Proc, log, meminfo

TTFT_P99_MS = 500.0
MIN_RATE = 50.0
MEMORY_SHARE = 0.80
SERVED = "targets"
CGROUP = Path("/sys/fs/cgroup")
INPUT_TOKENS, OUTPUT_TOKENS = 128, 64
SETTLE_S = 5.0  # quiet before each capacity probe


def ttft_p99_ms(result: Result, bound_ms: float = TTFT_P99_MS) -> float:
    """TTFT p99 over every request sent; refused, failed and long-waiting cut-off requests are misses."""
    miss = 1e15  # a finite stand-in for "never", so that percentiles interpolate; shown as inf
    values: list[float] = []
    for r in result.records:
        if (r.ok or r.cancelled) and r.ttft is not None:
            values.append(r.ttft * 1000)
        elif not r.cancelled or (r.e2e or 0) * 1000 >= bound_ms:
            values.append(miss)
    if not values:
        return math.nan
    p99 = loadgen.percentile(values, 99)
    return math.inf if p99 >= miss / 1e3 else p99


async def offered(server: Proc, args: argparse.Namespace, rate: float, duration: float, seed: int) -> dict[str, Any]:
    """Poisson arrivals at `rate` for `duration` seconds; the numbers the targets are judged on."""
    cfg = LoadConfig(base_url=server.base_url, model=SERVED, endpoint="completions", request_rate=rate, concurrency=None,
                     num_requests=max(1, math.ceil(rate * duration)), duration_s=duration, input_tokens=INPUT_TOKENS,
                     output_tokens=OUTPUT_TOKENS, ignore_eos=True, temperature=0.0, stream=True, seed=seed,
                     keep_records=True, label=f"rate={rate:g}", request_timeout_s=duration + 60)
    result = await loadgen.run_load(cfg)
    p99, sent = ttft_p99_ms(result), len(result.records)
    log(f"rate {rate:g}/s for {duration:g} s: {sent} sent, {result.completed} completed ({result.completed / duration:.2f}/s), "
        f"{result.failed} failed, {result.cancelled} cut off, TTFT p99 {p99:.0f} ms")
    waits = [r.e2e for r in result.records if r.cancelled and r.ttft is None and r.e2e is not None]
    return {"rate": rate, "duration_s": duration, "sent": sent, "completed": result.completed, "failed": result.failed,
            "cut_off": result.cancelled, "sustained_req_s": result.completed / duration, "ttft_p99_ms": p99,
            "cut_off_without_token": len(waits), "cut_off_wait_max_s": max(waits) if waits else None,
            "errors": result.errors, "result": result.to_dict()}


def verdicts(main_run: dict[str, Any], memory: dict[str, Any]) -> list[dict[str, Any]]:
    """Each target: what was measured, the bound, met or missed and by what factor."""
    sustained, p99, share = main_run["sustained_req_s"], main_run["ttft_p99_ms"], memory["judged_share"]
    return [
        {"target": f"sustained rate at {main_run['rate']:g} req/s offered", "measured": f"{sustained:.2f} req/s",
         "bound": f"> {MIN_RATE:g} req/s", "met": sustained > MIN_RATE,
         "factor": MIN_RATE / sustained if sustained > 0 else math.inf},
        {"target": "TTFT p99 under that load", "measured": f"{p99:.0f} ms", "bound": f"< {TTFT_P99_MS:g} ms",
         "met": p99 < TTFT_P99_MS, "factor": p99 / TTFT_P99_MS},
        {"target": f"memory ({memory['judged']})", "measured": f"{share:.1%}", "bound": f"≤ {MEMORY_SHARE:.0%}",
         "met": share <= MEMORY_SHARE, "factor": share / MEMORY_SHARE},
    ]


def cgroup_share() -> float | None:
    """This cgroup's memory use ÷ its limit (None when unlimited or not cgroup v2)."""
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        current = int((CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else current / int(limit)


def gpu_share() -> float | None:
    """Used ÷ total memory over all GPUs, per nvidia-smi (None without one)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False, timeout=10).stdout
    pairs = [tuple(float(x) for x in line.split(",")) for line in out.strip().splitlines() if "," in line]
    total = sum(t for _, t in pairs)
    return sum(u for u, _ in pairs) / total if total else None


async def memory_sample(server: Proc, client: httpx.AsyncClient) -> dict[str, float | None]:
    """The gateway's processes' and the machine's memory, the cgroup's and the GPUs' share, vLLM's KV cache use."""
    total = meminfo().get("MemTotal", 1)
    try:
        metrics = (await client.get(f"http://127.0.0.1:{server.port}/metrics")).text.splitlines()
        kv = max((float(line.rsplit(" ", 1)[1]) for line in metrics if line.startswith("vllm:kv_cache_usage_perc")),
                 default=None)
    except (httpx.HTTPError, ValueError, IndexError):
        kv = None
    return {"gateway": (server.rss() or 0) / total, "machine": 1 - meminfo().get("MemAvailable", 0) / total,
            "cgroup": cgroup_share(), "kv_cache": kv, "gpu": await asyncio.to_thread(gpu_share)}


def memory_summary(samples: list[dict[str, float | None]]) -> dict[str, Any]:
    peak = {key: max((v for s in samples if (v := s[key]) is not None), default=None) for key in samples[0]} if samples else {}
    cgroup = peak.get("cgroup")
    judged = "the pod's cgroup, peak" if cgroup is not None else "the gateway's processes ÷ the machine's memory, peak"
    return {"judged": judged, "judged_share": cgroup if cgroup is not None else (peak.get("gateway") or 0.0),
            **{f"{key}_peak": value for key, value in peak.items() if key != "cgroup"}, "samples": len(samples)}


async def capacity(server: Proc, args: argparse.Namespace) -> list[dict[str, Any]]:
    """Halve the rate until TTFT p99 < 500 ms holds (or the rate falls below --min-probe-rate)."""
    probes: list[dict[str, Any]] = []
    rate = args.rate / 2
    while rate >= args.min_probe_rate:
        await asyncio.sleep(SETTLE_S)
        probe = await offered(server, args, rate, args.probe_duration, seed=len(probes) + 10)
        probes.append({k: v for k, v in probe.items() if k != "result"})
        if probe["ttft_p99_ms"] < TTFT_P99_MS and probe["failed"] == 0:
            break
        rate /= 2
    return probes


async def check(args: argparse.Namespace, document: dict[str, Any]) -> None:
    command = [sys.executable, "-m", "gateway", "serve", "--served-model-name", SERVED,
               *(["--enforce-eager"] if args.eager else []), *args.gateway_args]
    server = Proc.on_free_port("gateway", command, {"GATEWAY_LOG_LEVEL": "warning"}, Path(document["logs"]))
    server.start()
    document["startup_s"] = await server.wait_ready(900)
    await loadgen.run_load(LoadConfig(base_url=server.base_url, model=SERVED, endpoint="completions", concurrency=4,
                                      num_requests=8, input_tokens=INPUT_TOKENS, output_tokens=OUTPUT_TOKENS, ignore_eos=True))
    async with httpx.AsyncClient() as client, procs.sampling(1.0, lambda: memory_sample(server, client)) as samples:
        document["main"] = await offered(server, args, args.rate, args.duration, seed=1)
    document["memory"] = memory_summary(samples)
    document["verdicts"] = verdicts(document["main"], document["memory"])
    if not all(v["met"] for v in document["verdicts"][:2]) and args.min_probe_rate > 0:
        document["capacity"] = await capacity(server, args)
    server.stop()


def report(document: dict[str, Any]) -> str:
    lines = ["| target | measured | bound | result |", "|---|---:|---:|---|"]
    for v in document.get("verdicts", []):
        result = "met" if v["met"] else f"MISSED by {v['factor']:.1f}x" if math.isfinite(v["factor"]) else "MISSED (nothing served in time)"
        lines.append(f"| {v['target']} | {v['measured']} | {v['bound']} | {result} |")
    memory = document.get("memory") or {}
    if memory:
        shares = {k: v for k, v in memory.items() if k.endswith("_peak") and v is not None}
        lines += ["", f"Memory (judged: {memory['judged']}): " + ", ".join(f"{k.removesuffix('_peak')} {v:.1%}" for k, v in shares.items())
                  + f" ({memory['samples']} samples)"]
    held = [p for p in document.get("capacity", []) if p["ttft_p99_ms"] < TTFT_P99_MS and p["failed"] == 0]
    if document.get("capacity"):
        if held:
            best = held[-1]["rate"]
            lines += ["", f"Capacity: TTFT p99 < {TTFT_P99_MS:g} ms held at {best:g} req/s offered "
                          f"(TTFT p99 {held[-1]['ttft_p99_ms']:.0f} ms over {held[-1]['duration_s']:g} s): "
                          f"{MIN_RATE / best:.1f}x below the {MIN_RATE:g} req/s target."]
        else:
            lines += ["", "Capacity: TTFT p99 < 500 ms held at no rate probed: " + ", ".join(f"{p['rate']:g}" for p in document["capacity"])]
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="The design's deployment targets on this hardware",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--rate", type=float, default=55.0, help="requests per second offered (Poisson)")
    p.add_argument("--duration", type=float, default=60.0, help="seconds of the main run")
    p.add_argument("--eager", action="store_true", help="--enforce-eager: quick start, slower decoding (not how to serve)")
    p.add_argument("--probe-duration", type=float, default=20.0, help="seconds of each capacity probe")
    p.add_argument("--min-probe-rate", type=float, default=0.25, help="lowest rate probed (0: no capacity search)")
    p.add_argument("gateway_args", nargs=argparse.REMAINDER, help="-- then flags for `gateway serve` (e.g. --model DIR)")
    return p


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    args.gateway_args = [a for a in args.gateway_args if a != "--"]
    verdicts_ = procs.run_command("targets", argv, args, check, report)[1].get("verdicts") or []
    return 0 if verdicts_ and all(v["met"] for v in verdicts_) else 1


if __name__ == "__main__":
    sys.exit(main())
