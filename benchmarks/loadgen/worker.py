"""One worker process of the load generator (`benchmarks.loadgen.workers` starts them):

    python -m benchmarks.loadgen.worker

It reads messages from stdin and writes its answers to a private copy of its stdout (print()
goes to stderr), length-prefixed pickles (`workers.read_frame`, `workers.write_frame`):
    ("run", Share)   warm up with the share's warm-up sessions, then answer ("ready",)
    ("go", origin)   run the share from that `time.perf_counter()` origin, sending ("progress",
                     n) now and then, then ("done", records, duration_s, cpu_s); ("error",
                     traceback) when the run raised
    ("stop",)        close the clients and exit (so does the end of stdin)
One aiohttp client per target is kept between runs (warm keep-alive connections).
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import time
import traceback
from typing import IO, Any

from benchmarks.loadgen.client import Client, make_client
from benchmarks.loadgen.config import LoadConfig
from benchmarks.loadgen.runner import Runner, run_async
from benchmarks.loadgen.workers import PROGRESS_EVERY_S, Share, read_frame, write_frame


class _Progress:
    """A bar for the runner that sends its count to the parent every PROGRESS_EVERY_S."""

    def __init__(self, out: IO[bytes]) -> None:
        self.out = out
        self.pending = 0
        self.sent_at = time.perf_counter()

    def update(self, n: int = 1) -> None:
        self.pending += n
        now = time.perf_counter()
        if now - self.sent_at >= PROGRESS_EVERY_S:
            self.close()
            self.sent_at = now

    def close(self) -> None:
        if self.pending:
            write_frame(self.out, ("progress", self.pending))
            self.pending = 0


def _client_key(config: LoadConfig) -> tuple[Any, ...]:
    return (config.base_url, config.api_key, tuple(sorted(config.headers.items())), config.request_timeout_s,
            config.http_client)


async def _run_share(share: Share, client: Client, reader: asyncio.StreamReader, out: IO[bytes]) -> bool:
    """Warm up, say ready, wait for the origin, run, send the records; False when told to stop instead."""
    cfg = share.config
    if cfg.warmup_requests and share.warmup_sessions:
        warm = dataclasses.replace(cfg, num_requests=cfg.warmup_requests, duration_s=None)
        await Runner(warm, client, share.model, share.warmup_sessions).run()
    write_frame(out, ("ready",))
    go = await read_frame(reader)
    if go is None or go[0] != "go":
        return False
    runner = Runner(cfg, client, share.model, share.sessions)
    progress = runner.bar = _Progress(out)
    cpu = time.process_time()
    duration = await runner.run(origin=go[1])
    cpu = time.process_time() - cpu
    progress.close()
    write_frame(out, ("done", runner.records, duration, cpu))
    return True


async def serve(out: IO[bytes]) -> None:
    """Run shares until told to stop (or the parent's end of the pipe closes)."""
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=2**20)
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    clients: dict[tuple[Any, ...], Client] = {}
    try:
        while (message := await read_frame(reader)) is not None and message[0] == "run":
            share: Share = message[1]
            key = _client_key(share.config)
            if key not in clients:
                clients[key] = make_client(share.config)
            try:
                if not await _run_share(share, clients[key], reader, out):
                    return
            except Exception:  # noqa: BLE001 - the parent raises it
                write_frame(out, ("error", traceback.format_exc()))
    finally:
        for client in clients.values():
            await client.close()


def main() -> int:
    out = os.fdopen(os.dup(sys.stdout.fileno()), "wb")
    os.dup2(sys.stderr.fileno(), sys.stdout.fileno())
    run_async(serve(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
