"""The race's `peers` part (issue 27): our gateway's remote path against the peer gateways, every one
forwarding to the same instant upstream, measured by the same client.

The peers (LiteLLM proxy, Portkey's gateway, TensorZero's gateway, the SGLang Model Gateway `smg`:
`benchmarks.peer_gateways`) are installed in folders of their own under ~/.cache/llm-gateway/peers
(pip venvs, an npm folder; once per version), each configured with one model routed to the instant
endpoint (`benchmarks.instant_endpoint`) and otherwise left at its defaults, logging included. Each
must answer one chat completion correctly before it is measured; a peer that cannot be installed,
started or answer is listed with the reason and left out of the rounds.

The targets take turns, who goes first rotating, at each concurrency level of each repetition, as in
`benchmarks.remote_path` (whose gateway set-up this reuses): `mock` (the instant endpoint alone: the
floor under every added latency and the client's own ceiling, since the endpoint costs next to
nothing), `llm-gateway` (a `kind: remote` model pointing at the mock, this checkout),
`llm-gateway-aa` (the same process measured again in its own slot: the noise floor) and each peer.
Non-streamed chat completions of 64 words and 16 output tokens, every request new; `--stream` adds
streamed rounds (time to first byte). Per target and level: req/s, latency p50/p99 and what it adds
to the mock's of the same round, and the CPU per request of the gateway's process tree (psutil,
user + system, children included, over the measured run). Medians over the repetitions.

    .venv/bin/python -m benchmarks.peers --repeats 5            # or: make peers ARGS='--repeats 5'
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks import peer_gateways
from benchmarks.loadgen import LoadConfig, run_load
from benchmarks.loadgen.client import make_client
from benchmarks.peer_gateways import MODEL, PEERS, PINS, InstallError, Route
from benchmarks.procs import REPO, RESULTS, Proc, free_port, log, md_table, run_command
from benchmarks.remote_path import gateway

OURS, AA, MOCK = "llm-gateway", "llm-gateway-aa", "mock"
TITLES = {MOCK: "mock alone (the client's ceiling)", OURS: "**llm-gateway, remote model**",
          AA: "llm-gateway again (A/A)"}
CHECK_TOKENS = 4


@dataclasses.dataclass
class Target:
    """A measured slot: its process (None: not ours to measure) and how requests reach it."""

    name: str
    proc: Proc
    route: Route
    cpu: bool = True  # measure the process tree's CPU

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.proc.port}{self.route.path}"


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--peers", nargs="*", default=list(PEERS), choices=list(PEERS), help="which peers (default: all)")
    p.add_argument("--pin", nargs="*", default=[], metavar="NAME=VERSION", help="another version of a peer")
    p.add_argument("--cache", type=Path, default=peer_gateways.CACHE, help="where the peers are installed")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--requests", type=int, default=2000, help="requests per run (at most)")
    p.add_argument("--max-seconds", type=float, default=10.0, help="time limit of one measured run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--stream", action="store_true", help="streamed rounds too (16 chunks each)")
    p.add_argument("--pause", type=float, default=0.5, help="seconds of quiet before each run")
    p.add_argument("--start-timeout", type=float, default=180.0, help="seconds for a gateway to answer once")
    return p.parse_args(argv)


# ----------------------------------------------------------------------------------------------
# Starting and checking


async def check_answer(target: Target, timeout_s: float) -> None:
    """Wait until the target answers one chat completion with the mock's words; raise after
    `timeout_s` or when its process has exited, with what it said last."""
    body = {"model": target.route.model, "messages": [{"role": "user", "content": "Say bare."}],
            "max_tokens": CHECK_TOKENS}
    headers = dict(target.route.headers)
    if target.route.api_key:
        headers["authorization"] = f"Bearer {target.route.api_key}"
    expected = " bare" * CHECK_TOKENS
    deadline, last = time.monotonic() + timeout_s, "no answer"
    async with httpx.AsyncClient(timeout=10, headers=headers) as client:
        while time.monotonic() < deadline:
            process = target.proc.process
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"exited with {process.returncode}: {last_line(target.proc.tail())}")
            try:
                answer = await client.post(f"{target.base_url}/chat/completions", json=body)
                content = answer.json()["choices"][0]["message"]["content"] if answer.status_code == 200 else None
                if content == expected:
                    return
                last = f"HTTP {answer.status_code}: {answer.text[:200]}" if content is None else f"wrong answer {content!r}"
            except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
                last = f"{exc.__class__.__name__}: {exc}"[:200]
            await asyncio.sleep(1)
    raise RuntimeError(f"no correct answer in {timeout_s:.0f} s ({last})")


def last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:200] if lines else "(empty log)"


async def wait_port(proc: Proc, timeout_s: float) -> None:
    """TensorZero's embedded gateway picks its own port: read it from the launcher's line."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        port = peer_gateways.tensorzero_port(proc.tail(20_000)) if proc.log_path.exists() else None
        if port is not None:
            proc.port = port
            return
        if proc.process is not None and proc.process.poll() is not None:
            raise RuntimeError(f"exited with {proc.process.returncode}: {last_line(proc.tail())}")
        await asyncio.sleep(0.5)
    raise RuntimeError(f"printed no BASE_URL in {timeout_s:.0f} s")


async def start_peer(name: str, version: str, args: argparse.Namespace, upstream: str, logs: Path,
                     status: dict[str, Any]) -> Target | None:
    """Install (unless done), start and check one peer; None (and the reason in `status`) when it fails."""
    peer = PEERS[name]
    try:
        home = await asyncio.to_thread(peer_gateways.install, peer, version, args.cache)
    except InstallError as exc:
        status.update(status="not installed", reason=str(exc))
        return None
    status["version"] = peer_gateways.installed_version(peer, home) or version
    port = free_port()
    launch = peer.launch(home, upstream, port, logs)
    proc = Proc(name, launch.command, launch.env, logs / f"{name}.log", port=None if launch.port_from_log else port)
    target = Target(name, proc, launch.route)
    try:
        proc.start()
        if launch.port_from_log:
            await wait_port(proc, args.start_timeout)
        took = time.monotonic()
        await check_answer(target, args.start_timeout)
        status.update(status="ran", reason=f"answered correctly ({time.monotonic() - took:.0f} s after start)")
        return target
    except (RuntimeError, OSError) as exc:
        status.update(status="did not start", reason=str(exc))
        proc.stop()
        return None


# ----------------------------------------------------------------------------------------------
# Measuring


async def measure(target: Target, level: int, repeat: int, stream: bool, args: argparse.Namespace,
                  client: Any) -> dict[str, Any]:
    config = LoadConfig(base_url=target.base_url, model=target.route.model, concurrency=level,
                        num_requests=args.requests, duration_s=args.max_seconds, input_tokens=64, output_tokens=16,
                        tokenizer="words", stream=stream, seed=repeat * 1000 + level, headers=dict(target.route.headers),
                        api_key=target.route.api_key, count_headers=[])
    warm = dataclasses.replace(config, num_requests=max(100, 4 * level), seed=config.seed + 7919)
    await run_load(warm, client=client)  # untimed: connections opened, pools filled
    before = target.proc.cpu_seconds() if target.cpu else None
    result = await run_load(config, client=client)
    after = target.proc.cpu_seconds() if target.cpu else None
    done = result.completed + result.failed
    cpu_ms = (after - before) / done * 1e3 if before is not None and after is not None and done else None
    return {"mode": "stream" if stream else "plain", "repeat": repeat, "level": level, "target": target.name,
            "req_s": result.request_throughput, "p50_ms": result.e2e.p50 * 1e3, "p99_ms": result.e2e.p99 * 1e3,
            "ttfb_p50_ms": result.ttft.p50 * 1e3 if stream else None,
            "ttfb_p99_ms": result.ttft.p99 * 1e3 if stream else None, "failed": result.failed,
            "errors": result.errors, "cpu_ms": cpu_ms, "load1": os.getloadavg()[0]}


def rotation(slots: list[Target], turn: int) -> list[Target]:
    """The slots in this turn's order: who goes first moves by one each turn."""
    shift = turn % len(slots)
    return slots[shift:] + slots[:shift]


async def rounds(slots: list[Target], args: argparse.Namespace, runs: list[dict[str, Any]]) -> None:
    """Every run of every slot, in turns; each target keeps one session of the load generator's
    client (its headers and key are the session's) for the whole race."""
    modes = [False, True] if args.stream else [False]
    turn = 0
    async with contextlib.AsyncExitStack() as stack:
        clients = {}
        for target in slots:
            session = make_client(LoadConfig(headers=dict(target.route.headers), api_key=target.route.api_key))
            clients[target.name] = await stack.enter_async_context(session)
        for repeat in range(args.repeats):
            for stream in modes:
                for level in args.concurrency:
                    for target in rotation(slots, turn):
                        if target.proc.process is not None and target.proc.process.poll() is not None:
                            continue  # died: its earlier runs stay, its status says so
                        await asyncio.sleep(args.pause)
                        run = await measure(target, level, repeat, stream, args, clients[target.name])
                        runs.append(run)
                        log(f"r{repeat} {run['mode']} c={level} {target.name}: {run['req_s']:.0f} req/s, "
                            f"p50 {run['p50_ms']:.2f} ms, p99 {run['p99_ms']:.2f} ms"
                            + (f", {run['cpu_ms']:.2f} ms CPU/request" if run["cpu_ms"] is not None else "")
                            + (f", {run['failed']} failed" if run["failed"] else ""))
                    turn += 1


async def work(args: argparse.Namespace, document: dict[str, Any]) -> None:
    logs = Path(document["logs"])
    pins = {**PINS, **dict(spec.split("=", 1) for spec in args.pin)}
    port = free_port()
    mock = Proc(MOCK, [sys.executable, "-m", "benchmarks.instant_endpoint", "--port", str(port), "--name", MODEL],
                {}, logs / "mock.log", port=port)
    mock.start()
    await mock.wait_ready(60)
    ours = gateway(OURS, REPO, mock.base_url, logs)
    ours.start()
    await ours.wait_ready(120)
    target = Target(OURS, ours, Route())
    await check_answer(target, args.start_timeout)
    slots = [Target(MOCK, mock, Route(), cpu=False), target, dataclasses.replace(target, name=AA)]
    statuses: list[dict[str, Any]] = document.setdefault("peers", [])
    for name in args.peers:
        status = {"name": name, "title": PEERS[name].title, "version": pins[name], "status": "", "reason": ""}
        statuses.append(status)
        peer = await start_peer(name, pins[name], args, mock.base_url, logs, status)
        log(f"{name} {status['version']}: {status['status']} ({status['reason']})")
        if peer is not None:
            slots.append(peer)
    document["targets"] = [slot.name for slot in slots]
    await rounds(slots, args, document.setdefault("runs", []))
    for slot in slots[3:]:
        process = slot.proc.process
        if process is not None and process.poll() is not None:
            status = next(s for s in statuses if s["name"] == slot.name)
            status.update(status="died during the rounds", reason=last_line(slot.proc.tail()))


# ----------------------------------------------------------------------------------------------
# Summary and tables (pure: tested in tests/tooling/test_peers.py)


def _median(values: list[float]) -> float | None:
    return statistics.median(values) if values else None


def summarize(document: dict[str, Any]) -> None:
    """Per mode, level and target: medians over the repetitions; added latencies against the mock's
    of the same repetition; the A/A ratio (llm-gateway-aa ÷ llm-gateway, per repetition)."""
    runs = document.get("runs", [])
    rows, aa = [], []
    for mode, level in sorted({(r["mode"], r["level"]) for r in runs}, key=lambda k: (k[0] != "plain", k[1])):
        at = [r for r in runs if r["mode"] == mode and r["level"] == level]
        mock = {r["repeat"]: r for r in at if r["target"] == MOCK}
        for target in document.get("targets", []):
            mine = [r for r in at if r["target"] == target]
            if not mine:
                continue
            paired = [(r, mock[r["repeat"]]) for r in mine if r["repeat"] in mock and target != MOCK]
            ttfb = [(r["ttfb_p50_ms"] - m["ttfb_p50_ms"], r["ttfb_p99_ms"] - m["ttfb_p99_ms"])
                    for r, m in paired if r.get("ttfb_p50_ms") is not None]
            rows.append({"mode": mode, "level": level, "target": target,
                         "req_s": _median([r["req_s"] for r in mine]), "p50_ms": _median([r["p50_ms"] for r in mine]),
                         "p99_ms": _median([r["p99_ms"] for r in mine]),
                         "added_p50_ms": _median([r["p50_ms"] - m["p50_ms"] for r, m in paired]),
                         "added_p99_ms": _median([r["p99_ms"] - m["p99_ms"] for r, m in paired]),
                         "added_ttfb_ms": _median([t[0] for t in ttfb]),
                         "added_ttfb_p99_ms": _median([t[1] for t in ttfb]),
                         "cpu_ms": _median([r["cpu_ms"] for r in mine if r["cpu_ms"] is not None]),
                         "failed": sum(r["failed"] for r in mine), "runs": len(mine)})
        base = {r["repeat"]: r["req_s"] for r in at if r["target"] == OURS}
        ratios = [r["req_s"] / base[r["repeat"]] for r in at if r["target"] == AA and base.get(r["repeat"])]
        if ratios:
            aa.append({"mode": mode, "level": level, "median": statistics.median(ratios), "min": min(ratios),
                       "max": max(ratios)})
    document["summary"], document["aa"] = rows, aa


def _fmt(value: float | None, digits: int = 2) -> str:
    return "" if value is None else f"{value:,.{digits}f}"


def title(document: dict[str, Any], target: str) -> str:
    peer = next((p for p in document.get("peers", []) if p["name"] == target), None)
    if peer is None:
        return TITLES.get(target, target)
    name, _, language = peer["title"].partition(" (")
    return f"{name} {peer['version']} ({language}" if language else f"{name} {peer['version']}"


ADDED = {"plain": (("added_p50_ms", "added p50 ms"), ("added_p99_ms", "added p99 ms")),
         "stream": (("added_ttfb_ms", "added TTFB p50 ms"), ("added_ttfb_p99_ms", "added TTFB p99 ms"))}


def headline(document: dict[str, Any], mode: str) -> list[str]:
    """One row per target: req/s at the first level, the latency it adds there (p50, p99; time to
    first byte for streams), req/s at the other levels, CPU per request at every level."""
    rows = [r for r in document.get("summary", []) if r["mode"] == mode]
    levels = sorted({r["level"] for r in rows})
    if not levels:
        return []
    first, by = levels[0], {(r["target"], r["level"]): r for r in rows}
    added = ADDED[mode]
    header = " | ".join(["gateway", f"c={first} req/s", *(f"{label} at c={first}" for _, label in added),
                         *(f"c={c} req/s" for c in levels[1:]), *(f"CPU ms/req c={c}" for c in levels), "failed"])
    table = []
    for target in document.get("targets", []):
        cells = [by.get((target, c)) for c in levels]
        if not any(cells):
            continue
        mock = target == MOCK
        rates = [_fmt(c["req_s"], 0) if c else "" for c in cells]
        extra = ["—" if mock else _fmt((cells[0] or {}).get(key)) for key, _ in added]
        cpu = ["—" if mock else _fmt(c["cpu_ms"]) if c else "" for c in cells]
        table.append([title(document, target), rates[0], *extra, *rates[1:], *cpu,
                      str(sum(c["failed"] for c in cells if c))])
    return md_table(header, table, left=("gateway",))


def details(document: dict[str, Any]) -> list[str]:
    rows = [(r["mode"], r["level"], r["target"], _fmt(r["req_s"], 0), _fmt(r["p50_ms"]), _fmt(r["p99_ms"]),
             _fmt(r["added_p50_ms"]), _fmt(r["added_p99_ms"]), _fmt(r["added_ttfb_ms"]), _fmt(r["added_ttfb_p99_ms"]), _fmt(r["cpu_ms"]), r["failed"])
            for r in document.get("summary", [])]
    return md_table("mode | c | target | req/s | p50 ms | p99 ms | added p50 ms | added p99 ms | added TTFB p50 ms | "
                    "added TTFB p99 ms | CPU ms/request | failed", rows, left=("mode", "target"))


def render(document: dict[str, Any]) -> str:
    lines = [f"`{document['command']}`", ""]
    lines += md_table("peer | version | status | why", [(p["title"], p["version"], p["status"], p["reason"])
                                                         for p in document.get("peers", [])], left=("peer", "version", "status", "why"))
    for mode in ("plain", "stream"):
        table = headline(document, mode)
        if table:
            lines += ["", f"{'Streamed' if mode == 'stream' else 'Non-streamed'} chat completions, medians of "
                      f"{document['settings']['repeats']} rounds:", "", *table]
    loads = [r["load1"] for r in document.get("runs", []) if r.get("load1") is not None]
    if loads:
        lines += ["", f"Load average (1 min) over the runs: {min(loads):.1f} to {max(loads):.1f}, median "
                  f"{statistics.median(loads):.1f}, on {document.get('machine', {}).get('nproc', '?')} cores (the other "
                  "work on the machine shows here)."]
    if document.get("aa"):
        lines += ["", "A/A (llm-gateway measured twice, req/s ratio, median [smallest, largest] of the rounds): "
                  + "; ".join(f"{a['mode']} c={a['level']} {a['median']:.2f} [{a['min']:.2f}, {a['max']:.2f}]"
                              for a in document["aa"])]
    lines += ["", "Per level:", "", *details(document)]
    if document.get("error"):
        lines += ["", f"Stopped early: {document['error']}"]
    return "\n".join(lines)


def write_markdown(document: dict[str, Any], text: str) -> Path:
    out = RESULTS / f"peers-{document['started']}.md"
    out.write_text(text + "\n")
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    started = time.monotonic()
    code, document, _ = run_command("peers", argv, parse(argv), work, render, RESULTS, finish=summarize)
    log(f"table: {write_markdown(document, render(document))}; took {time.monotonic() - started:.0f} s")
    return code


if __name__ == "__main__":
    sys.exit(main())
