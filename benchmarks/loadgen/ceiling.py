"""The client's ceiling: after a measured run, the same load sent for `ceiling_s` seconds to the
instant endpoint (started once per process), beside the run as the client's headroom (wanted >=
`WANTED_HEADROOM`). At concurrency 1 it is bound by a loopback round trip's latency, not by CPU.
"""

from __future__ import annotations

import atexit
import dataclasses
import sys
from pathlib import Path
from typing import Any

from benchmarks.loadgen.config import LoadConfig
from benchmarks.loadgen.results import Result
from benchmarks.procs import Proc, free_port

WANTED_HEADROOM = 5.0
BARE_MODEL = "bare"
LOG_DIR = Path(__file__).resolve().parents[1] / "results"

_endpoint: Proc | None = None


async def shared_endpoint(start_timeout_s: float = 60.0) -> Proc:
    """The instant endpoint, started on first use and stopped when this process exits."""
    global _endpoint
    if _endpoint is None or _endpoint.process is None or _endpoint.process.poll() is not None:
        port = free_port()
        command = [sys.executable, "-m", "benchmarks.instant_endpoint", "--port", str(port), "--name", BARE_MODEL]
        proc = Proc("instant-endpoint", command, {}, LOG_DIR / f"instant-endpoint-{port}.log", port=port)
        proc.start()
        atexit.register(proc.stop)
        await proc.wait_ready(start_timeout_s)
        _endpoint = proc
    return _endpoint


def ceiling_config(config: LoadConfig, base_url: str) -> LoadConfig:
    """The measured run's load, sent to the instant endpoint for `ceiling_s` seconds (no request cap)."""
    concurrency = config.concurrency or 64
    return dataclasses.replace(
        config, base_url=base_url, model=BARE_MODEL, tokenizer="words", api_key=None, headers={},
        concurrency=concurrency, request_rate=None, num_requests=10**9, duration_s=config.ceiling_s,
        unique_prompts=min(256, max(1, config.num_requests)), warmup_requests=2 * concurrency,
        progress=False, keep_records=False, ceiling_s=0.0, label=f"{config.label or 'run'} ceiling",
    )


def compare(bare: Result, measured: Result) -> dict[str, Any]:
    """The ceiling beside the measured run: rates, the headroom (ceiling ÷ measured) and whether it is
    enough; `latency_bound`: one request at a time, so a round trip's latency, not the client's CPU."""
    req = bare.request_throughput / measured.request_throughput if measured.request_throughput > 0 else None
    tok = bare.output_throughput / measured.output_throughput if measured.output_throughput > 0 else None
    headroom = min((r for r in (req, tok) if r is not None), default=None)
    return {"req_s": bare.request_throughput, "output_tok_s": bare.output_throughput, "completed": bare.completed,
            "failed": bare.failed, "duration_s": bare.duration_s, "client_cpu_s": bare.client_cpu_s,
            "endpoint": "benchmarks.instant_endpoint",
            "latency_bound": bare.config.get("concurrency") == 1 and not bare.config.get("request_rate"),
            "headroom_req_s": req, "headroom_tok_s": tok, "headroom": headroom,
            "enough": headroom is not None and headroom >= WANTED_HEADROOM}


def describe(ceiling: dict[str, Any]) -> str:
    """One line for people."""
    headroom = ceiling.get("headroom")
    text = (f"client ceiling (instant endpoint, same load, {ceiling['duration_s']:.1f} s): {ceiling['req_s']:.0f} req/s, {ceiling['output_tok_s']:.0f} tok/s")
    if headroom is None:
        return text + " (nothing measured to compare)"
    text += f" = {headroom:.1f}x this run"
    if not ceiling["enough"]:
        text += f" - below {WANTED_HEADROOM:.0f}x: the client may be part of what this run measured"
        if ceiling.get("latency_bound"):
            text += (" (at concurrency 1 the ceiling is one loopback round trip at a time, bound by latency, "
                     "not by the client's CPU)")
    return text + (f"; {ceiling['failed']} failed" if ceiling.get("failed") else "")
