"""Memory while benchmarks.targets loads the gateway: sampled every second, peaks kept.

Judged: the pod's cgroup (v2 `memory.current` ÷ `memory.max`) when a limit is set, else the
gateway's processes (front end, engine core, worker: RSS) ÷ the machine's memory. Reported beside:
the machine's overall use (other processes included), vLLM's KV-cache use from /metrics, and GPU
memory from nvidia-smi when there is one.
"""

from __future__ import annotations

import asyncio
import shutil
import subprocess
from pathlib import Path
from typing import Any

import aiohttp
import psutil

from benchmarks.procs import Proc, meminfo

CGROUP = Path("/sys/fs/cgroup")


def cgroup_share() -> float | None:
    """This cgroup's memory use ÷ its limit (None when unlimited or not cgroup v2)."""
    try:
        limit = (CGROUP / "memory.max").read_text().strip()
        current = int((CGROUP / "memory.current").read_text())
    except (OSError, ValueError):
        return None
    return None if limit == "max" else current / int(limit)


def tree_rss(pid: int) -> int:
    root = psutil.Process(pid)
    total = 0
    for proc in [root, *root.children(recursive=True)]:
        try:
            total += proc.memory_info().rss
        except psutil.NoSuchProcess:
            pass
    return total


def gpu_share() -> float | None:
    """Used ÷ total memory over all GPUs, per nvidia-smi (None without one)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used,memory.total", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False, timeout=10).stdout
    pairs = [tuple(float(x) for x in line.split(",")) for line in out.strip().splitlines() if "," in line]
    total = sum(t for _, t in pairs)
    return sum(u for u, _ in pairs) / total if total else None


async def kv_cache_usage(session: aiohttp.ClientSession, port: int) -> float | None:
    async with session.get(f"http://127.0.0.1:{port}/metrics") as response:
        text = await response.text()
    values = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
              if line.startswith("vllm:kv_cache_usage_perc") or line.startswith("vllm:gpu_cache_usage_perc")]
    return max(values) if values else None


class MemorySampler:
    def __init__(self, server: Proc, every_s: float = 1.0) -> None:
        self.server, self.every_s = server, every_s
        self.samples: list[dict[str, float | None]] = []
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self._stop.set()

    async def run(self) -> None:
        assert self.server.process is not None and self.server.port is not None
        total = meminfo().get("MemTotal", 1)
        async with aiohttp.ClientSession() as session:
            while not self._stop.is_set():
                mem = meminfo()
                try:
                    kv = await kv_cache_usage(session, self.server.port)
                except (aiohttp.ClientError, ValueError, IndexError):
                    kv = None
                self.samples.append({
                    "gateway": tree_rss(self.server.process.pid) / total,
                    "machine": 1 - mem.get("MemAvailable", 0) / total,
                    "cgroup": cgroup_share(), "kv_cache": kv, "gpu": await asyncio.to_thread(gpu_share),
                })
                try:
                    await asyncio.wait_for(self._stop.wait(), self.every_s)
                except TimeoutError:
                    pass

    def peak(self, key: str) -> float | None:
        values = [s[key] for s in self.samples if s.get(key) is not None]
        return max(values) if values else None  # type: ignore[type-var]

    def summary(self) -> dict[str, Any]:
        cgroup = self.peak("cgroup")
        judged = "the pod's cgroup, peak" if cgroup is not None else "the gateway's processes ÷ the machine's memory, peak"
        return {"judged": judged, "judged_share": cgroup if cgroup is not None else (self.peak("gateway") or 0.0),
                "gateway_peak": self.peak("gateway"), "machine_peak": self.peak("machine"), "kv_cache_peak": self.peak("kv_cache"),
                "gpu_peak": self.peak("gpu"), "samples": len(self.samples)}
