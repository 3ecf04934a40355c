"""Running the load: `run_load` (one measured run at one concurrency or request rate, with its
warm-up, and the client's ceiling after it when `ceiling_s` asks: the same load for `ceiling_s`
seconds against the instant endpoint, started once per process), `run_sweep` (one run per
concurrency level), `run_async` (on uvloop), and the command line: `python -m benchmarks.loadgen`
(a flag per `LoadConfig` field; the JSON)."""

from __future__ import annotations

import argparse
import asyncio
import atexit
import dataclasses
import itertools
import json
import math
import os
import random
import sys
import time
import typing
from collections.abc import Coroutine, Sequence
from pathlib import Path
from typing import Any, Literal, TypeVar

import uvloop

from benchmarks.loadgen.client import Client, discover_model, make_client, send_request
from benchmarks.loadgen.prompts import Session, build_sessions, get_tokenizer, request_body, sessions_needed
from benchmarks.loadgen.results import LoadConfig, RequestRecord, Result, aggregate, compare, format_result
from benchmarks.procs import RESULTS, Proc, timestamp


class Runner:
    """One run's state: its records (one per request issued so far), the sessions in turn, the time limit."""

    def __init__(self, config: LoadConfig, client: Client, model: str, sessions: Sequence[Session]) -> None:
        self.config, self.client, self.model, self.sessions = config, client, model, itertools.cycle(sessions)
        self.url = f"{config.base_url.rstrip('/')}/{'chat/completions' if config.endpoint == 'chat' else 'completions'}"
        self.records: list[RequestRecord] = []
        self.origin, self.deadline, self.last_end = 0.0, math.inf, 0.0

    def _may_issue(self) -> bool:
        return len(self.records) < self.config.num_requests and time.perf_counter() < self.deadline

    async def run_session(self, session: Session) -> None:
        """The session's turns one after the other, each carrying the real answers so far."""
        history: list[tuple[str, str]] = []
        for turn in session.turns:
            if not self._may_issue():
                return
            self.records.append(record := RequestRecord())
            await send_request(self.client, self.url, request_body(self.config, self.model, session, history, turn), record,
                               count_headers=self.config.count_headers, origin=self.origin,
                               estimate_input=0 if history else session.input_tokens)
            self.last_end = time.perf_counter()
            if not record.ok:
                return
            history.append((turn, record.text))

    async def workers(self, count: int) -> None:
        async def worker() -> None:
            while self._may_issue():
                await self.run_session(next(self.sessions))

        await asyncio.gather(*(worker() for _ in range(count)))

    async def arrivals(self, rate: float, rng: random.Random) -> None:
        """Poisson arrivals of sessions, at most `concurrency` running (when set)."""
        limit = asyncio.Semaphore(self.config.concurrency or 1 << 30)

        async def start(session: Session) -> None:
            async with limit:
                await self.run_session(session)

        turns = self.config.turns if self.config.prompts == "multi-turn" else 1
        next_at = time.perf_counter()
        async with asyncio.TaskGroup() as group:  # cancelled with the run: its requests in flight too
            for _ in range(math.ceil(self.config.num_requests / turns)):
                if time.perf_counter() >= self.deadline:
                    break
                group.create_task(start(next(self.sessions)))
                next_at += rng.expovariate(rate)
                if (delay := next_at - time.perf_counter()) > 0:
                    await asyncio.sleep(delay)

    async def run(self) -> float:
        """Run until the count or the time limit; returns the measured duration in seconds. At the time
        limit (or when this run is cancelled), the requests in flight are cancelled and counted as such."""
        cfg = self.config
        self.origin = time.perf_counter()
        self.deadline = self.origin + cfg.duration_s if cfg.duration_s else math.inf
        work = self.arrivals(cfg.request_rate, random.Random(cfg.seed + 1)) if cfg.request_rate else \
            self.workers(max(1, cfg.concurrency or 1))
        try:
            await asyncio.wait_for(work, cfg.duration_s or None)
        except TimeoutError:
            return time.perf_counter() - self.origin
        return (self.last_end or time.perf_counter()) - self.origin


async def run_load(config: LoadConfig, sessions: Sequence[Session] | None = None, client: Client | None = None,
                   warmup_sessions: Sequence[Session] | None = None) -> Result:
    """One measured run at one concurrency (or request rate), after its warm-up; it stops after num_requests
    or duration_s. Sessions not given are built (the warm-up's from a seed of their own)."""
    own = client is None
    client = client or make_client(config)
    warm_cfg = dataclasses.replace(config, num_requests=config.warmup_requests, duration_s=None)
    try:
        model = config.model or await discover_model(client, config.base_url)
        tokenizer = None
        if sessions is None or (config.warmup_requests and warmup_sessions is None):
            tokenizer = await get_tokenizer(config, client, model)
        if sessions is None:
            sessions = await build_sessions(config, sessions_needed(config), tokenizer)
        if config.warmup_requests:
            warmup_sessions = warmup_sessions or await build_sessions(warm_cfg, sessions_needed(warm_cfg), tokenizer,
                                                                      seed=config.seed + 7919)
            await Runner(warm_cfg, client, model, warmup_sessions).run()
        runner = Runner(config, client, model, sessions)
        cpu = time.process_time()
        duration = await runner.run()
        cpu = time.process_time() - cpu
    finally:
        if own:
            await client.close()
    result = aggregate(runner.records, duration, label=config.label, concurrency=config.concurrency,
                       request_rate=config.request_rate, config={**config.to_dict(), "model": model},
                       keep_records=config.keep_records)
    result.client_cpu_s = cpu
    if config.ceiling_s > 0:  # the same load against the instant endpoint, beside this run
        endpoint = await shared_endpoint()
        result.ceiling = compare(await run_load(ceiling_config(config, endpoint.base_url)), result)
    return result


BARE_MODEL = "bare"
_endpoint: Proc | None = None


async def shared_endpoint(start_timeout_s: float = 60.0) -> Proc:
    """The instant endpoint, started on first use and stopped when this process exits."""
    global _endpoint
    if _endpoint is None or _endpoint.process is None or _endpoint.process.poll() is not None:
        command = [sys.executable, "-m", "benchmarks.instant_endpoint", "--name", BARE_MODEL]
        _endpoint = Proc.on_free_port(f"instant-endpoint-{os.getpid()}", command, {}, RESULTS)
        atexit.register(_endpoint.stop)
        await _endpoint.launch(start_timeout_s)
    return _endpoint


def ceiling_config(config: LoadConfig, base_url: str) -> LoadConfig:
    """The measured run's load, sent to the instant endpoint for `ceiling_s` seconds (no request cap)."""
    concurrency = config.concurrency or 64
    return dataclasses.replace(
        config, base_url=base_url, model=BARE_MODEL, tokenizer="words", api_key=None, headers={},
        concurrency=concurrency, request_rate=None, num_requests=10**9, duration_s=config.ceiling_s,
        unique_prompts=min(256, max(1, config.num_requests)), warmup_requests=2 * concurrency,
        keep_records=False, ceiling_s=0.0, label=f"{config.label or 'run'} ceiling",
    )


async def run_sweep(config: LoadConfig, levels: Sequence[int], waves: int | None = None) -> list[Result]:
    """One run per concurrency level, each with its own fresh prompts (no prefix-cache help across levels)."""
    results = []
    async with make_client(config) as client:
        for i, level in enumerate(levels):
            n = max(config.num_requests, waves * level) if waves else config.num_requests
            cfg = dataclasses.replace(config, concurrency=level, num_requests=n, seed=config.seed + 1000 * i,
                                      label=config.label or f"c={level}")
            results.append(await run_load(cfg, client=client))
            print(format_result(results[-1]), file=sys.stderr)
    return results


T = TypeVar("T")


def run_async(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run` on uvloop (uvicorn[standard] brings it): less loop overhead per request."""
    return uvloop.run(coro)


# ----------------------------------------------------------------------------------------------
# The command line: a flag per LoadConfig field, typed and defaulted by it (benchmarks/README.md says
# what each does), a few of them renamed or shaped for people

FLAGS = {"duration_s": "--duration", "warmup_requests": "--warmup", "request_timeout_s": "--request-timeout",
         "keep_records": "--save-requests", "ceiling_s": "--ceiling-duration", "count_headers": "--count-header"}
OWN = ("concurrency", "stream", "headers", "label")  # flags of their own below, or none


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.loadgen", argument_default=argparse.SUPPRESS,
                                description="A load generator for any OpenAI-compatible server (benchmarks/README.md)")
    hints = typing.get_type_hints(LoadConfig)
    for f in (f for f in dataclasses.fields(LoadConfig) if f.name not in OWN):
        flag, kind = FLAGS.get(f.name, "--" + f.name.replace("_", "-")), hints[f.name]
        if kind is bool:
            p.add_argument(flag, dest=f.name, action="store_true")
        elif typing.get_origin(kind) is Literal:
            p.add_argument(flag, dest=f.name, choices=typing.get_args(kind))
        elif typing.get_origin(kind) in (dict, list):
            p.add_argument(flag, dest=f.name, **({"type": json.loads} if typing.get_origin(kind) is dict else {"action": "append"}))
        else:  # int, float, str, or one of them or None
            p.add_argument(flag, dest=f.name, type=next(a for a in typing.get_args(kind) or (kind,) if a is not type(None)))
    p.add_argument("--concurrency", type=int, nargs="+", default=None, help="several levels: a sweep; with --request-rate: a cap")
    p.add_argument("--no-stream", dest="stream", action="store_false")
    p.add_argument("--no-ceiling", dest="ceiling_s", action="store_const", const=0.0)
    p.add_argument("--waves", type=int, default=None, help="at least WAVES x concurrency requests per level")
    p.add_argument("--output", type=Path, default=None, help="the JSON file (default benchmarks/results/loadgen-<time>.json)")
    return p


def config_from(args: argparse.Namespace) -> LoadConfig:
    """The flags given into a LoadConfig; unlike LoadConfig's, the CLI's defaults measure the client's
    ceiling for 2 s; --duration 0 is no limit, a negative --temperature the server's default."""
    given = {f.name: getattr(args, f.name) for f in dataclasses.fields(LoadConfig) if hasattr(args, f.name)}
    config = LoadConfig(**{"ceiling_s": 2.0, **given, "concurrency": None})
    return dataclasses.replace(
        config, concurrency=args.concurrency[0] if args.concurrency else (None if config.request_rate else 8),
        duration_s=config.duration_s or None, temperature=None if (config.temperature or 0) < 0 else config.temperature,
        count_headers=[h.lower() for h in config.count_headers])


def main(argv: list[str] | None = None) -> int:
    """Run (one Poisson run at --request-rate, else a sweep of the --concurrency levels) and write the
    JSON; exit status 1 when a run completed nothing."""
    args = parser().parse_args(argv)
    config = config_from(args)
    if config.request_rate:
        results = [run_async(run_load(dataclasses.replace(config, label=f"rate={config.request_rate}")))]
        print(format_result(results[0]), file=sys.stderr)
    else:
        results = run_async(run_sweep(config, args.concurrency or [8], args.waves))
    stamp = timestamp()
    output = args.output or RESULTS / f"loadgen-{stamp}.json"
    output.parent.mkdir(parents=True, exist_ok=True)
    document = {"tool": "benchmarks.loadgen", "started": stamp, "argv": sys.argv if argv is None else ["loadgen", *argv],
                "config": config.to_dict(), "results": [r.to_dict(records=config.keep_records) for r in results]}
    output.write_text(json.dumps(document, indent=2))
    print(f"results: {output}", file=sys.stderr)
    return 0 if all(r.completed for r in results) else 1
