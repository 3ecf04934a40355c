"""The load from several processes (`LoadConfig.processes`, the CLI's `--processes`): one aiohttp
client costs tens of microseconds of CPU per request, so one process tops out near one core; N
worker processes each send a share of the load and the records come back to be merged into one
`Result`, as if one client had sent them.

    async with WorkerPool(2) as pool:
        records, duration, cpu = await pool.measure(config, model, sessions, warmup_sessions, bar)

`split` cuts a run into shares: the concurrency (and a Poisson rate) in proportion, the request
count likewise, the sessions round-robin (a multi-turn conversation stays in one process), the
warm-up too. Each worker (`python -m benchmarks.loadgen.worker`, talking length-prefixed pickles
over its stdin and a private copy of its stdout) warms up, says it is ready, and starts at the
one origin the parent sends to all (`time.perf_counter` is the system's monotonic clock, the same
in every process), so the records' start times and the run's duration are on one time line. A
worker keeps its aiohttp client per target between runs (warm keep-alive connections, as one
process's sweep does). The progress bar is the parent's, fed by the workers' counts.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import pickle
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import IO, Any

from benchmarks.loadgen.config import LoadConfig, client_processes
from benchmarks.loadgen.progress import Bar
from benchmarks.loadgen.prompts import Session
from benchmarks.loadgen.results import RequestRecord

PROGRESS_EVERY_S = 0.2
START_MARGIN_S = 0.005  # the origin is this far after the last worker said ready


@dataclass
class Share:
    """One worker's part of a run."""

    config: LoadConfig  # with its own concurrency, request count and rate; one process, no bar, no ceiling
    model: str
    sessions: list[Session]
    warmup_sessions: list[Session]


def _parts(total: int, weights: Sequence[int]) -> list[int]:
    """`total` cut in proportion to `weights` (largest remainders), summing to `total`."""
    whole = sum(weights)
    exact = [total * w / whole for w in weights]
    parts = [int(x) for x in exact]
    for i in sorted(range(len(weights)), key=lambda i: exact[i] - parts[i], reverse=True)[: total - sum(parts)]:
        parts[i] += 1
    return parts


def workers_for(config: LoadConfig) -> int:
    """How many processes a run uses (`config.client_processes`)."""
    return client_processes(config.processes, config.concurrency)


def split(config: LoadConfig, model: str, sessions: Sequence[Session], warmup_sessions: Sequence[Session] | None,
          n: int) -> list[Share]:
    """The run cut into `n` shares (see the module's docstring)."""
    weights = _parts(config.concurrency, [1] * n) if config.concurrency is not None else [1] * n
    requests = _parts(config.num_requests, weights)
    warmups = _parts(config.warmup_requests, weights)
    shares = []
    for i in range(n):
        rate = config.request_rate * weights[i] / sum(weights) if config.request_rate else None
        cfg = dataclasses.replace(
            config, concurrency=weights[i] if config.concurrency is not None else None, request_rate=rate,
            num_requests=requests[i], warmup_requests=warmups[i], processes=1, progress=False, ceiling_s=0.0,
            keep_records=True, seed=config.seed + 104729 * i,
        )
        mine = list(sessions[i::n]) or list(sessions[:1])
        warm = list((warmup_sessions or [])[i::n]) or list((warmup_sessions or [])[:1])
        shares.append(Share(cfg, model, mine, warm))
    return shares


# ---------------------------------------------------------------------------------------------
# the parent's side


class _Worker:
    """One worker process and its pipes."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process

    async def send(self, message: Any) -> None:
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        assert self.process.stdin is not None
        self.process.stdin.write(len(data).to_bytes(8, "little") + data)
        await self.process.stdin.drain()

    async def recv(self) -> Any:
        assert self.process.stdout is not None
        message = await read_frame(self.process.stdout)
        if message is None:
            raise RuntimeError(f"load generator worker {self.process.pid} exited (status {self.process.returncode})")
        return message

    async def expect(self, kind: str, bar: _Counts | None = None) -> tuple[Any, ...]:
        """The next message of this kind; progress counts go to `bar` meanwhile; an error is raised."""
        while True:
            message = await self.recv()
            if message[0] == kind:
                return tuple(message[1:])
            if message[0] == "progress" and bar is not None:
                bar.add(message[1])
            elif message[0] == "error":
                raise RuntimeError(f"load generator worker {self.process.pid} failed:\n{message[1]}")


class _Counts:
    """The workers' progress counts into the parent's bar."""

    def __init__(self, bar: Bar | None) -> None:
        self.bar = bar

    def add(self, n: int) -> None:
        if self.bar is not None and n:
            self.bar.update(n)


class WorkerPool:
    """`size` worker processes, started on entry and stopped on exit."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.workers: list[_Worker] = []

    async def __aenter__(self) -> WorkerPool:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        for _ in range(self.size):
            process = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "benchmarks.loadgen.worker", stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE, env=env, limit=2**20,
            )
            self.workers.append(_Worker(process))
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        for worker in self.workers:
            try:
                await worker.send(("stop",))
            except (ConnectionError, RuntimeError):
                pass
        for worker in self.workers:
            try:
                await asyncio.wait_for(worker.process.wait(), 10)
            except TimeoutError:
                worker.process.kill()
                await worker.process.wait()
        self.workers = []

    async def measure(self, config: LoadConfig, model: str, sessions: Sequence[Session],
                      warmup_sessions: Sequence[Session] | None, bar: Bar | None = None
                      ) -> tuple[list[RequestRecord], float, float]:
        """One run over the workers: the merged records (by start time), the duration from the common
        origin to the last worker's end, and the workers' CPU seconds during the run, summed."""
        shares = split(config, model, sessions, warmup_sessions, min(self.size, workers_for(config)))
        workers = self.workers[: len(shares)]
        for worker, share in zip(workers, shares, strict=True):
            await worker.send(("run", share))
        for worker in workers:
            await worker.expect("ready")
        origin = time.perf_counter() + START_MARGIN_S
        for worker in workers:
            await worker.send(("go", origin))
        counts = _Counts(bar)
        done = await asyncio.gather(*(worker.expect("done", counts) for worker in workers))
        records = sorted((r for part in done for r in part[0]), key=lambda r: r.start)
        return records, max(part[1] for part in done), sum(part[2] for part in done)


def write_frame(out: IO[bytes], message: Any) -> None:
    """One message: its pickle's length (8 bytes, little-endian), then the pickle."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(len(data).to_bytes(8, "little") + data)
    out.flush()


async def read_frame(reader: asyncio.StreamReader) -> Any:
    """The next message, or None at the end of the pipe."""
    try:
        head = await reader.readexactly(8)
        return pickle.loads(await reader.readexactly(int.from_bytes(head, "little")))
    except asyncio.IncompleteReadError:
        return None
