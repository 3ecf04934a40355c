"""Worker processes serving one listening socket, and the parent that supervises them: signals forwarded, and
one worker's exit stops them all."""

from __future__ import annotations

import contextlib
import ipaddress
import multiprocessing
import os
import signal
import socket
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from multiprocessing.context import SpawnContext, SpawnProcess
from types import FrameType
from typing import Any

import structlog

log = structlog.get_logger(__name__)

STARTUP_FAILED = 3  # uvicorn's own status for a failed start-up (as `gateway.server.cli`)
WORKER_DIED = 1
BACKLOG = 2048  # uvicorn's default backlog
TICK_S = 0.5
# a worker that drained and stopped: 0, or the SIGTERM it was sent, raised again by uvicorn once
# it has stopped (uvicorn.Server.capture_signals), as the one-process gateway ends too
CLEAN_EXITS = (0, -signal.SIGTERM)
SPAWN: SpawnContext = multiprocessing.get_context("spawn")  # the workers and the shared engine cores


def listen(host: str, port: int) -> socket.socket:
    """As uvicorn binds one; inherited by `spawn` workers (multiprocessing passes it as a file descriptor)."""
    try:
        family = socket.AF_INET6 if ipaddress.ip_address(host).version == 6 else socket.AF_INET
    except ValueError:  # a name: what it resolves to first
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    # SO_REUSEADDR, and an IPv6 socket takes IPv4 too (V6ONLY off, as uvicorn leaves it); closed if the bind fails
    sock = socket.create_server((host, port), family=family, backlog=BACKLOG, dualstack_ipv6=family == socket.AF_INET6)
    sock.set_inheritable(True)
    return sock


@dataclass(frozen=True)
class WorkerSeat:
    """What a worker process gets: its index, the listening socket, and the pipe on which it says it serves."""

    index: int
    sock: socket.socket
    ready: Connection

    def announce(self) -> None:
        self.ready.send("ready")
        self.ready.close()


WorkerMain = Callable[[WorkerSeat, Any], int]  # (seat, payload) → exit status; a module-level function


def _worker(main: WorkerMain, seat: WorkerSeat, payload: Any) -> None:
    sys.exit(main(seat, payload))


class Supervisor:
    """Starts `len(payloads)` workers running `main(seat, payloads[i])` on `sock`, and supervises them. A worker that
    exits by itself stops the others and the parent exits 1, with no restart: a worker dies of what would kill its
    replacement too, and the orchestrator restarting the whole pod starts from a known state."""

    def __init__(self, main: WorkerMain, payloads: Sequence[Any], sock: socket.socket, stop_timeout_s: float) -> None:
        self.main = main
        self.payloads = list(payloads)
        self.sock = sock
        self.stop_timeout_s = stop_timeout_s
        self.workers: list[SpawnProcess] = []
        self._signals: list[int] = []
        self._stopping = False
        self._deadline = 0.0

    def run(self, on_ready: Callable[[], None] = lambda: None, on_tick: Callable[[], None] = lambda: None,
            on_spawned: Callable[[], None] = lambda: None) -> int:
        """`on_spawned`: what the workers inherited can be closed there. The exit status."""
        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
        try:
            self._start()
            on_spawned()
            if not self._await_ready():
                self._stop("start-up failed")
                self._supervise(lambda: None)  # until they are gone
                return STARTUP_FAILED
            on_ready()
            return self._supervise(on_tick)
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
            for worker in self.workers:
                if worker.is_alive():
                    worker.kill()
                    worker.join(5)

    def _on_signal(self, sig: int, frame: FrameType | None) -> None:
        self._signals.append(sig)  # acted on in the loop, outside the handler

    def _start(self) -> None:
        self._pipes: list[Connection] = []
        for index, payload in enumerate(self.payloads):
            receiving, sending = SPAWN.Pipe(duplex=False)
            seat = WorkerSeat(index, self.sock, sending)
            worker = SPAWN.Process(target=_worker, args=(self.main, seat, payload), name=f"gateway-worker-{index}")
            worker.start()
            sending.close()
            self.workers.append(worker)
            self._pipes.append(receiving)
        log.info("workers_started", workers=len(self.workers), pids=[w.pid for w in self.workers])

    def _await_ready(self) -> bool:
        waiting = {pipe: worker for pipe, worker in zip(self._pipes, self.workers, strict=True)}
        while waiting:
            if self._handle_signals():
                return False
            for ready in wait([*waiting, *(w.sentinel for w in waiting.values())], TICK_S):
                if ready in waiting and isinstance(ready, Connection):
                    with contextlib.suppress(EOFError, OSError):
                        if ready.recv() == "ready":
                            del waiting[ready]
                            continue
                    log.error("worker_failed_to_start", pid=waiting[ready].pid, exitcode=waiting[ready].exitcode)
                    return False
                if any(w.sentinel == ready for w in waiting.values()):
                    return False
        return True

    def _handle_signals(self) -> bool:
        """Forward the signals received; True once stopping."""
        while self._signals:
            sig = self._signals.pop(0)
            if sig == signal.SIGHUP:
                log.info("reload_forwarded", workers=len(self.workers))
                self._send(signal.SIGHUP)
            else:
                self._stop(signal.Signals(sig).name)
        return self._stopping

    def _send(self, sig: int) -> None:
        for worker in self.workers:
            if worker.is_alive() and worker.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(worker.pid, sig)

    def _stop(self, reason: str) -> None:
        if self._stopping:
            return
        self._stopping = True
        self._deadline = time.monotonic() + self.stop_timeout_s
        log.info("workers_stopping", reason=reason, timeout_s=self.stop_timeout_s)
        self._send(signal.SIGTERM)

    def _supervise(self, on_tick: Callable[[], None]) -> int:
        died = False
        while any(w.is_alive() for w in self.workers):
            self._handle_signals()
            on_tick()
            wait([w.sentinel for w in self.workers if w.is_alive()], TICK_S)
            for worker in self.workers:
                if not worker.is_alive() and not self._stopping:
                    log.error("worker_died", pid=worker.pid, exitcode=worker.exitcode)
                    died = True
                    self._stop(f"worker {worker.pid} exited with {worker.exitcode}")
            if self._stopping and time.monotonic() >= self._deadline:
                self._kill_rest()
        codes = [w.exitcode for w in self.workers]
        log.info("workers_stopped", exitcodes=codes)
        return WORKER_DIED if died or any(code not in CLEAN_EXITS for code in codes) else 0

    def _kill_rest(self) -> None:
        for worker in self.workers:
            if worker.is_alive():
                log.warning("worker_killed", pid=worker.pid, timeout_s=self.stop_timeout_s)
                worker.kill()

    @property
    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.pid is not None]
