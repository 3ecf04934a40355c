"""Fair shares counted in tokens (#39 item 3): one key floods long prompts at `--heavy` requests in
flight beside a light key at `--light`, both in the normal class, for `--seconds`, once with each order
of admission (`admission.fairness.order`: vtc, then fcfs), a gateway each. Reported per order: the light
key's time to first token and its share of the weighted service (prompt tokens x input_weight + output
tokens x output_weight of the completed requests whose first token came while both keys were sending),
and the heavy key's lead in that service, beside the paper's bound on the difference in service between
two backlogged keys, 2 x max(w_in x L_in, w_out x M), M the tokens the running requests hold
(max_running x (prompt + output)). At `--light` 2 the light key is not backlogged (it keeps two requests
out, and is served as it asks): the bound is a yardstick there; `--backlogged` adds the pair with the light
key at `--heavy` requests in flight too, where both keys always wait and the bound applies.

    .venv/bin/python -m benchmarks.fairness --engine echo
    .venv/bin/python -m benchmarks.fairness --engine real --seconds 60
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LoadConfig, build_sessions, run_load
from benchmarks.procs import Proc, log, md_table, run_command
from gateway.settings import FairnessSettings

MODEL = "smollm2-135m-instruct"
KEYS = """
keys:
  heavy: {key: sk-heavy}
  light: {key: sk-light}
"""
ORDERS = ("vtc", "fcfs")
SESSIONS = 256  # prompts per key, made before its run starts (its requests' times count from there)
WEIGHTS = FairnessSettings()


def config(base_url: str, key: str, concurrency: int, input_tokens: int, output_tokens: int, seconds: float,
           seed: int) -> LoadConfig:
    return LoadConfig(base_url=base_url, model=MODEL, api_key=key, tokenizer="words", concurrency=concurrency,
                      num_requests=10**9, duration_s=seconds, input_tokens=input_tokens, output_tokens=output_tokens,
                      ignore_eos=True, seed=seed, keep_records=True, unique_prompts=SESSIONS)


def service(result: Any, started: float, window: tuple[float, float]) -> float:
    """The weighted tokens of the completed requests whose first token came within `window` (clock times)."""
    return sum(WEIGHTS.input_weight * r.input_tokens + WEIGHTS.output_weight * r.output_tokens for r in result.records
               if r.ok and r.ttft is not None and window[0] <= started + r.start + r.ttft <= window[1])


async def one_order(order: str, light_in_flight: int, args: argparse.Namespace, folder: Path) -> dict[str, Any]:
    env = {"GATEWAY_KEYS_FILE": str(folder / "keys.yaml"), "GATEWAY_CACHE__BACKEND": "off",
           "GATEWAY_ADMISSION__MAX_RUNNING": str(args.max_running), "GATEWAY_ADMISSION__MAX_WAITING": "1024",
           "GATEWAY_ADMISSION__WAIT_TIMEOUT_S": "600", "GATEWAY_ADMISSION__FAIRNESS__ORDER": order,
           "GATEWAY_LOG_LEVEL": "warning", "GATEWAY_RATE_LIMIT_RPM": "1000000", "GATEWAY_BATCHES__ENABLED": "false",
           "GATEWAY_ENGINE__ENFORCE_EAGER": "true"}
    if args.engine == "echo":
        command = [sys.executable, "-m", "benchmarks.echo_engine", "--name", MODEL, "--token-delay", str(args.token_delay)]
    else:
        command = [sys.executable, "-m", "gateway", "serve"]
    gateway = await Proc.on_free_port(f"gateway-{order}", command, env, folder, api_key="sk-light").launch(900)
    try:
        heavy_config = config(gateway.base_url, "sk-heavy", args.heavy, args.heavy_prompt, args.heavy_output,
                              args.seconds, 1)
        light_config = config(gateway.base_url, "sk-light", light_in_flight, args.light_prompt, args.light_output,
                              args.seconds - args.settle_s, 2)
        prompts = [await build_sessions(c, SESSIONS, None) for c in (heavy_config, light_config)]
        heavy_started = time.perf_counter()
        heavy = asyncio.create_task(run_load(heavy_config, prompts[0]))
        await asyncio.sleep(args.settle_s)  # the flood queued up ahead of the light key
        light_started = time.perf_counter()
        light = await run_load(light_config, prompts[1])
        flood = await heavy
    finally:
        gateway.stop()
    window = (light_started, light_started + args.seconds - args.settle_s)
    w_heavy, w_light = service(flood, heavy_started, window), service(light, light_started, window)
    row = {"order": order, "light_in_flight": light_in_flight, "light_completed": light.completed,
           "light_ttft_p50_s": light.ttft.p50,
           "light_ttft_p90_s": light.ttft.p90, "heavy_completed": flood.completed, "heavy_ttft_p50_s": flood.ttft.p50,
           "service_heavy": w_heavy, "service_light": w_light,
           "light_share": w_light / (w_heavy + w_light) if w_heavy + w_light else 0.0}
    log(f"{order}, light at {light_in_flight}: light TTFT p50 {row['light_ttft_p50_s']:.2f} s, share {row['light_share']:.1%}")
    return row


async def work(args: argparse.Namespace, document: dict[str, Any]) -> None:
    folder = Path(document["logs"])
    (folder / "keys.yaml").write_text(KEYS)
    held = args.max_running * (args.heavy_prompt + args.heavy_output)
    document["paper_bound"] = 2 * max(WEIGHTS.input_weight * args.heavy_prompt, WEIGHTS.output_weight * held)
    rows = document["orders"] = []
    for light in (args.light, args.heavy) if args.backlogged else (args.light,):
        for order in ORDERS:
            rows.append(await one_order(order, light, args, folder))


def render(document: dict[str, Any]) -> str:
    rows = document.get("orders", [])
    lines = md_table("order | light in flight | light TTFT p50 | light TTFT p90 | light done | heavy done | "
                     "light share of service | heavy lead (weighted tokens)",
                     ([r["order"], r["light_in_flight"], f"{r['light_ttft_p50_s'] * 1000:,.0f} ms", f"{r['light_ttft_p90_s'] * 1000:,.0f} ms",
                       r["light_completed"], r["heavy_completed"], f"{r['light_share']:.1%}",
                       f"{r['service_heavy'] - r['service_light']:,.0f}"] for r in rows), left=("order",))
    lines.append(f"\npaper's bound on the difference between two backlogged keys: {document.get('paper_bound', 0):,.0f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engine", choices=("echo", "real"), default="echo")
    parser.add_argument("--seconds", type=float, default=30, help="how long the flood runs, per order")
    parser.add_argument("--settle-s", type=float, default=3, help="the flood's head start")
    parser.add_argument("--heavy", type=int, default=64, help="the heavy key's requests in flight")
    parser.add_argument("--heavy-prompt", type=int, default=1024)
    parser.add_argument("--heavy-output", type=int, default=32)
    parser.add_argument("--light", type=int, default=2, help="the light key's requests in flight")
    parser.add_argument("--light-prompt", type=int, default=16)
    parser.add_argument("--light-output", type=int, default=16)
    parser.add_argument("--backlogged", action="store_true", help="also: the light key at --heavy in flight")
    parser.add_argument("--max-running", type=int, default=8, help="admission max_running")
    parser.add_argument("--token-delay", type=float, default=0.01, help="echo engine: seconds between output tokens")
    argv = sys.argv[1:] if argv is None else argv
    return run_command("fairness", argv, parser.parse_args(argv), work, render)[0]


if __name__ == "__main__":
    sys.exit(main())
