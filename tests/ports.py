"""Ports for tests without races: a server binds port 0 and says which port it got; no test picks a
free port for something else to bind later (another process could take it in between).

`listening_line`: the port a gateway started with `--port 0` got, from its log (`gateway.server.http`
logs `listening` once its sockets are bound).

`closed_port`: a port where nothing listens, for as long as it is needed (a connection to it is
refused): the port stays bound by the test, without listening, so that no other server takes it.
"""

from __future__ import annotations

import contextlib
import json
import re
import socket
from collections.abc import Iterator

CONSOLE_EVENT = re.compile(r"\]\s+listening\s")  # after the level: `... [info     ] listening   host=...`
CONSOLE_PORT = re.compile(r"\bport=(\d+)")
CONSOLE_SCHEME = re.compile(r"\bscheme=(https?)\b")


@contextlib.contextmanager
def closed_port(host: str = "127.0.0.1") -> Iterator[int]:
    """A loopback port held bound but not listening: connecting to it is refused (Linux answers RST)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        yield int(sock.getsockname()[1])


def listening_line(log: str) -> tuple[str, int] | None:
    """The scheme and port of the gateway's first `listening` line in `log` (JSON lines or console
    lines, as `gateway.telemetry.logs` writes them); None before it is logged."""
    for line in log.splitlines():
        if line.startswith("{"):
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict) and record.get("event") == "listening":
                return str(record["scheme"]), int(record["port"])
        elif CONSOLE_EVENT.search(line) and (port := CONSOLE_PORT.search(line)) and (scheme := CONSOLE_SCHEME.search(line)):
            return scheme[1], int(port[1])
    return None
