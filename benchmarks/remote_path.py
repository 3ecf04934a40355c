"""The front-gateway path at the limit (issue 27): gateway versions (`--versions NAME=DIR`: a
checkout each, imported with `python -P` and PYTHONPATH=DIR) forwarding to the instant endpoint as a
remote model, taking turns with the mock alone (the floor under the latency each adds) and an A/A
slot (`<first>-aa`: the first target's process again). Per target and level: req/s, latency
p50/p99 and what the gateway adds to the mock's of the same round, its CPU per request (the whole
process tree); ratios to the first target as median [smallest, largest] of the per-repetition ratios.

`--servers uvicorn granian` (issue 43) serves every version with each HTTP server in turn (granian:
ASGI, uvloop, one worker; it must be importable, e.g. `pip install --target DIR granian` and DIR on
PYTHONPATH); `--engine echo` serves the echo engine (no upstream, no mock slot) instead of the remote
model; `--tls` serves HTTPS with a throwaway CA (trustme) that the load generator trusts.

    .venv/bin/python -m benchmarks.remote_path --versions before=/tmp/before after=. --repeats 5
    .venv/bin/python -m benchmarks.remote_path --servers uvicorn granian --engine echo --tls
    .venv/bin/python -m benchmarks.remote_path --repeats 1 --concurrency 64 --profile 18   # and where the time goes
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import subprocess
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
    p.add_argument("--servers", nargs="+", choices=SERVERS, default=["uvicorn"], help="the HTTP servers, each in turn")
    p.add_argument("--engine", choices=("remote", "echo"), default="remote",
                   help="remote: a remote model on the instant endpoint; echo: the echo engine, no upstream")
    p.add_argument("--tls", action="store_true", help="HTTPS (a throwaway CA the load generator trusts)")
    p.add_argument("--workers", type=int, nargs="+", default=[1], help="worker processes, each count in turn")
    p.add_argument("--profile", type=int, metavar="SECONDS", default=0,
                   help="after the rounds, py-spy each gateway this long at the highest level, by part of the path")
    return p.parse_args(argv)


SERVERS = ("uvicorn", "granian")


def gateway(name: str, directory: Path, upstream: str | None, logs: Path, server: str = "uvicorn",
            tls: tuple[str, str] | None = None, workers: int = 1) -> Proc:
    """A gateway of the checkout in `directory` whose one model is a remote one at `upstream` (None: the echo
    engine), served by `server` in `workers` processes; `tls`: (certificate, key) files."""
    env = {**GATEWAY_ENV, "PYTHONPATH": os.pathsep.join(
        filter(None, [str(directory.resolve()), os.environ.get("PYTHONPATH")]))}
    if upstream is not None:
        models = logs / f"models-{name}.yaml"
        models.write_text(f"models:\n  - {{name: {MODEL}, kind: remote, url: '{upstream}', upstream_model: {MODEL}}}\n")
        env["GATEWAY_MODELS_FILE"] = str(models)
    if tls is not None:
        env.update(GATEWAY_TLS__ENABLED="true", GATEWAY_TLS__CERT_FILE=tls[0], GATEWAY_TLS__KEY_FILE=tls[1])
    if server == "granian":
        command = [sys.executable, "-P", "-m", "benchmarks.remote_path", "granian", "--engine",
                   "remote" if upstream else "echo", "--workers", str(workers)]
    elif upstream is not None:
        command = [sys.executable, "-P", "-m", "gateway", "serve", "--workers", str(workers)]
    elif workers > 1:
        command = [sys.executable, "-P", "-m", "benchmarks.workers", "echo-workers", str(workers)]
    else:
        command = [sys.executable, "-P", "-m", "benchmarks.echo_engine", "--name", MODEL]
    proc = Proc.on_free_port(name, command, env, logs)
    if tls is not None:
        proc.scheme = "https"
    return proc


def granian_app() -> Any:
    """The app a granian worker serves (its factory): as `gateway serve` or `benchmarks.echo_engine` builds it."""
    from gateway.settings import Settings
    from gateway.telemetry.logs import configure

    settings = Settings(warmup=False)
    configure(settings.log_level, settings.log_format)
    if os.environ.get("BENCH_ENGINE") == "echo":
        from benchmarks.echo_engine import create_echo_app, echo_engine

        return create_echo_app(settings, echo_engine(MODEL))
    from gateway.app import create_app

    return create_app(settings)


def serve_granian(argv: list[str]) -> int:
    """`granian --engine remote|echo --port P`: the gateway app under granian (ASGI, uvloop, HTTP/1, one worker),
    TLS from the gateway's own settings."""
    from granian.constants import HTTPModes, Interfaces, Loops
    from granian.server import Server

    p = argparse.ArgumentParser()
    p.add_argument("--engine", default="remote")
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--workers", type=int, default=1)
    args = p.parse_args(argv)
    os.environ["BENCH_ENGINE"] = args.engine
    tls = {"ssl_cert": Path(os.environ["GATEWAY_TLS__CERT_FILE"]), "ssl_key": Path(os.environ["GATEWAY_TLS__KEY_FILE"])} \
        if os.environ.get("GATEWAY_TLS__ENABLED") == "true" else {}
    Server("benchmarks.remote_path:granian_app", address="127.0.0.1", port=args.port, interface=Interfaces.ASGI,
           factory=True, loop=Loops.uvloop, http=HTTPModes.http1, workers=args.workers, log_access=False, **tls).serve()
    return 0


def test_certificate(logs: Path) -> tuple[str, str]:
    """A server certificate for 127.0.0.1 from a throwaway CA, which this process's TLS clients trust from now on
    (the load generator's default context reads SSL_CERT_FILE)."""
    import trustme

    ca = trustme.CA()
    cert = ca.issue_cert("127.0.0.1", "localhost")
    ca.cert_pem.write_to_path(str(logs / "ca.pem"))
    cert.cert_chain_pems[0].write_to_path(str(logs / "cert.pem"))
    cert.private_key_pem.write_to_path(str(logs / "key.pem"))
    os.environ["SSL_CERT_FILE"] = str(logs / "ca.pem")
    return str(logs / "cert.pem"), str(logs / "key.pem")


async def work(args: argparse.Namespace, document: dict[str, Any]) -> None:
    logs = Path(document["logs"])
    mock = None
    if args.engine == "remote":
        mock = await Proc.on_free_port("mock", [sys.executable, "-m", "benchmarks.instant_endpoint", "--name", MODEL],
                                       {}, logs).launch(60)
    tls = test_certificate(logs) if args.tls else None
    versions = [spec.split("=", 1) for spec in args.versions]
    named = [("/".join([name, *[server] * (len(args.servers) > 1), *[f"w{n}"] * (len(args.workers) > 1)]),
              Path(directory), server, n)
             for name, directory in versions for server in args.servers for n in args.workers]
    servers = {name: gateway(name.replace("/", "-"), directory, mock.base_url if mock else None, logs, server, tls, n)
               for name, directory, server, n in named}
    await asyncio.gather(*(server.launch(120) for server in servers.values()))
    slots: list[tuple[str, Proc]] = [*([("mock", mock)] if mock else []), *servers.items()]
    first = named[0][0]
    if not args.no_aa:
        slots.append((f"{first}-aa", servers[first]))
    document["loadavg"] = []
    document["targets"] = [name for name, _ in slots]
    runs: list[dict[str, Any]] = document.setdefault("runs", [])
    async with make_client(LoadConfig()) as client:
        for repeat in range(args.repeats):
            document["loadavg"].append(os.getloadavg())
            for i, level in enumerate(args.concurrency):
                mock_run: dict[str, Any] = {}
                for name, proc in rotated(slots, repeat * len(args.concurrency) + i):
                    await asyncio.sleep(args.pause)
                    config = LoadConfig(base_url=proc.base_url, model=MODEL if mock else None, concurrency=level, num_requests=args.requests,
                                        duration_s=120, input_tokens=64, output_tokens=16, tokenizer="words",
                                        stream=args.stream, seed=repeat * 1000 + level)
                    warm = dataclasses.replace(config, num_requests=max(100, 4 * level), seed=config.seed + 7919)
                    await run_load(warm, client=client)  # untimed: connections opened, pools filled
                    cpu = None if proc is mock else proc.cpu_seconds()  # granian's worker is a child
                    result = await run_load(config, client=client)
                    spent = None if proc is mock else proc.cpu_seconds()
                    metrics = {"req_s": result.request_throughput, "p50_ms": result.e2e.p50 * 1e3,
                               "p99_ms": result.e2e.p99 * 1e3, "failed": result.failed,
                               "cpu_ms": None if cpu is None or spent is None
                               else (spent - cpu) / (result.completed + result.failed) * 1e3}
                    runs.append({"repeat": repeat, "concurrency": level, "target": name, "metrics": metrics})
                    log(f"r{repeat} c={level} {name}: {metrics['req_s']:.0f} req/s, p50 {metrics['p50_ms']:.2f} ms, "
                        f"p99 {metrics['p99_ms']:.2f} ms, {num(metrics['cpu_ms'], 2)} ms CPU/request, {result.failed} failed")
                    mock_run = metrics if proc is mock else mock_run
                # what each gateway adds to the mock's latency of this round (the mock's slot may come after theirs)
                for run in runs[-len(slots):] if mock_run else ():
                    run["metrics"].update(added_p50_ms=run["metrics"]["p50_ms"] - mock_run["p50_ms"],
                                          added_p99_ms=run["metrics"]["p99_ms"] - mock_run["p99_ms"])
        if args.profile:
            await profile(args, servers, mock is not None, client, logs, document)


async def profile(args: argparse.Namespace, servers: dict[str, Proc], remote: bool, client: Any, logs: Path,
                  document: dict[str, Any]) -> None:
    """py-spy (raw, 200 Hz, its worker processes too) on each gateway under steady load at the highest level, then
    `benchmarks.profile_breakdown` over all of them: the table of where the time goes."""
    level, profiles = max(args.concurrency), []
    for name, proc in servers.items():
        assert proc.process is not None
        out = logs / f"profile-{name.replace('/', '-')}.txt"
        config = LoadConfig(base_url=proc.base_url, model=MODEL if remote else None, concurrency=level,
                            num_requests=10**8, duration_s=args.profile + 6, input_tokens=64, output_tokens=16,
                            tokenizer="words", stream=args.stream, seed=4242)
        load = asyncio.create_task(run_load(config, client=client))
        await asyncio.sleep(3)  # steady load first
        document["loadavg"].append(os.getloadavg())
        spy = await asyncio.create_subprocess_exec(
            str(Path(sys.executable).parent / "py-spy"), "record", "--subprocesses", "-p", str(proc.process.pid),
            "-d", str(args.profile), "-r", "200", "-f", "raw", "-o", str(out),
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        await spy.wait()
        result = await load
        log(f"profiled {name}: {result.request_throughput:.0f} req/s meanwhile")
        profiles.append(str(out))
    breakdown = await asyncio.create_subprocess_exec(sys.executable, "-m", "benchmarks.profile_breakdown", *profiles,
                                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    document["profile_table"] = (await breakdown.communicate())[0].decode()


def summarize(document: dict[str, Any]) -> None:
    """Medians per target and level, the range of req/s, and every version's ratios to the first's."""
    runs, targets = document.get("runs", []), document.get("targets", [])
    document["summary"], document["ratios"] = [], []
    gateways = [t for t in targets if t != "mock"]
    for level in sorted({run["concurrency"] for run in runs}):
        medians = paired(runs, level, targets[0], METRICS)["medians"]
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
             num(r["p50_ms"], 2), num(r["p99_ms"], 2), *(("", "") if r["target"] == "mock" or r["added_p50_ms"] is None else
                                                          (num(r["added_p50_ms"], 2), num(r["added_p99_ms"], 2))),
             "" if r["cpu_ms"] is None else num(r["cpu_ms"], 2)) for r in document.get("summary", [])]
    ratios = [(r["level"], r["ratio"], r["of"], f"{r['median']:.2f} [{r['min']:.2f}, {r['max']:.2f}]")
              for r in document.get("ratios", [])]
    loads = ", ".join(f"{a:.1f}" for a, _, _ in document.get("loadavg", []))
    return "\n".join([f"`{document['command']}`", "", f"load average (1 min) at each round's start: {loads}", "",
                      *md_table("c | target | req/s median [range] | p50 ms | p99 ms | added p50 ms | added p99 ms | "
                                "gateway CPU ms/request", rows, left=("target",)),
                      "", *md_table("c | ratio | of | median [smallest, largest]", ratios, left=("ratio", "of")),
                      "", document.get("profile_table", "")])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["granian"]:
        return serve_granian(argv[1:])
    return run_command("remote_path", argv, parse(argv), work, render, RESULTS, finish=summarize)[0]


if __name__ == "__main__":
    sys.exit(main())
