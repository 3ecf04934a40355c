"""Trivial worker functions for `gateway.server.supervisor` (tests/unit/test_supervisor.py), in a module of their
own: a `spawn` worker imports the module of the function it runs, and this one imports only the supervisor (a
fraction of a second), where the test module imports the gateway's settings and workers (seconds a worker)."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from gateway.server.supervisor import WorkerSeat


def answer_index(seat: WorkerSeat, payload: Any) -> int:
    """A worker: each connection gets `index pid`; SIGTERM ends it with 0, SIGHUP touches `payload`."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if payload is not None:
        signal.signal(signal.SIGHUP, lambda *_: Path(payload, f"hup-{seat.index}").touch())
    seat.announce()
    while True:
        conn, _ = seat.sock.accept()
        with conn:
            conn.sendall(f"{seat.index} {os.getpid()}".encode())


def die_after_start(seat: WorkerSeat, payload: Any) -> int:
    if seat.index == 1:
        seat.announce()
        time.sleep(0.5)  # the behaviour: a worker that served a while, then died
        return 7
    return answer_index(seat, payload)


def never_start(seat: WorkerSeat, payload: Any) -> int:
    return 5 if seat.index == 0 else answer_index(seat, payload)
