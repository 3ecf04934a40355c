"""Priority under a flood (#28 item 2), on the real CPU engine: the time to first token of
interactive requests at c=1 (normal class) alone, beside a flood of low-priority streams, beside the
same flood at the interactive requests' own class, and alone again (the A/A pair), in rounds, side
by side in one gateway.

    .venv/bin/python -m benchmarks.priority --rounds 3 --probes 8
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LoadConfig, run_load
from benchmarks.procs import Proc, log, md_table, median, run_command

MODEL = "smollm2-135m-instruct"
KEYS = """
keys:
  interactive: {key: sk-interactive}
  batch-low: {key: sk-low, priority: low}
  batch-normal: {key: sk-normal}
"""
SCENARIOS = {"alone": None, "flood-low": "sk-low", "flood-normal": "sk-normal", "alone-again": None}  # -> the flood's key


def config(base_url: str, key: str, **kwargs: Any) -> LoadConfig:
    return LoadConfig(base_url=base_url, model=MODEL, api_key=key, tokenizer="words", input_tokens=16, **kwargs)


async def scenario(base_url: str, name: str, args: argparse.Namespace, round_no: int) -> float:
    """The median TTFT (s) of `--probes` interactive requests, one at a time, beside this scenario's flood."""
    flood = None
    if key := SCENARIOS[name]:  # streams sent again as each ends, until the probes are done
        flood = asyncio.create_task(run_load(config(base_url, key, concurrency=args.flood, num_requests=10**9,
                                                    duration_s=None, output_tokens=args.flood_tokens, ignore_eos=True,
                                                    seed=round_no + 1000)))
        await asyncio.sleep(args.settle_s)  # the flood's requests admitted and generating
    probes = await run_load(config(base_url, "sk-interactive", concurrency=1, num_requests=args.probes,
                                   output_tokens=args.probe_tokens, seed=100 * round_no + len(name)))
    if flood is not None:
        flood.cancel()  # the client leaves: its engine requests are aborted
        with contextlib.suppress(asyncio.CancelledError):
            await flood
        await asyncio.sleep(args.settle_s)
    if probes.failed or not probes.completed:
        raise RuntimeError(f"interactive requests failed beside {name}: {probes.errors}")
    log(f"round {round_no} {name}: median TTFT {probes.ttft.p50 * 1000:.0f} ms")
    return probes.ttft.p50


async def work(args: argparse.Namespace, document: dict[str, Any]) -> None:
    folder = Path(document["logs"])
    (folder / "keys.yaml").write_text(KEYS)
    env = {"GATEWAY_KEYS_FILE": str(folder / "keys.yaml"), "GATEWAY_CACHE__BACKEND": "off",
           "GATEWAY_ADMISSION__MAX_RUNNING": str(args.max_running), "GATEWAY_ADMISSION__MAX_WAITING": "1024",
           "GATEWAY_ADMISSION__WAIT_TIMEOUT_S": "600", "GATEWAY_LOG_LEVEL": "warning",
           "GATEWAY_RATE_LIMIT_RPM": "1000000", "GATEWAY_ENGINE__ENFORCE_EAGER": str(args.eager).lower()}
    gateway = await Proc.on_free_port("gateway", [sys.executable, "-m", "gateway", "serve"], env, folder,
                                      api_key="sk-interactive").launch(900)
    await run_load(config(gateway.base_url, "sk-interactive", concurrency=1, num_requests=1, output_tokens=4))  # warm-up
    rounds = document["median_ttft_s"] = []
    for r in range(args.rounds):
        rounds.append({name: await scenario(gateway.base_url, name, args, r) for name in SCENARIOS})


def render(document: dict[str, Any]) -> str:
    rounds = document.get("median_ttft_s", [])
    lines = md_table("round | " + " | ".join(SCENARIOS), ([i, *(f"{m[name] * 1000:,.0f} ms" for name in SCENARIOS)]
                                                          for i, m in enumerate(rounds) if len(m) == len(SCENARIOS)))
    for name, over in (("flood-low", "alone"), ("flood-normal", "alone"), ("alone-again", "alone")):
        values = [m[name] / m[over] for m in rounds if len(m) == len(SCENARIOS)]
        lines.append(f"\n{name} / {over}: " + ", ".join(f"{v:.2f}" for v in values) + f" (median {median(values) or 0:.2f})")
    return "\n".join(lines)


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
    argv = sys.argv[1:] if argv is None else argv
    return run_command("priority", argv, parser.parse_args(argv), work, render)[0]


if __name__ == "__main__":
    sys.exit(main())
