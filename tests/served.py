"""Apps on the fake engine behind real uvicorn servers (in threads of the test process), on free
loopback ports: for tests that need real HTTP between gateways (a remote model's upstream, two
replicas sharing one Redis)."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator
from typing import Any

import uvicorn

from tests.fakes import FakeEngine, app_with
from tests.waits import until_sync

HOST = "127.0.0.1"
WAIT_S = 30  # a bound on waiting for the server, not a measurement


@contextlib.contextmanager
def served(app: Any) -> Iterator[str]:
    """`app` served on a free port; its base URL (http://127.0.0.1:PORT)."""
    with running(uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False))) as port:
        yield f"http://{HOST}:{port}"


@contextlib.contextmanager
def running(server: uvicorn.Server) -> Iterator[int]:
    """`server` run in a thread on a free loopback port (yielded once it has started)."""
    sock = socket.socket()
    sock.bind((HOST, 0))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        until_sync(lambda: server.started or not thread.is_alive(), WAIT_S, "the server started")
        assert server.started, "the server did not start"
        yield int(sock.getsockname()[1])
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        sock.close()


@contextlib.contextmanager
def gateway(engine: FakeEngine | None = None, **settings: Any) -> Iterator[str]:
    """The gateway on the fake engine with these settings, served."""
    with served(app_with(engine or FakeEngine(), **settings)) as base:
        yield base
