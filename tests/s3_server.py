"""A real S3-compatible server for the S3 store's tests: moto's S3 over HTTP (in memory), in a child
process of its own, bound to port 0 on loopback; the child prints the port it got (no port picked
beforehand). Stopping it kills the process, so its clients' connections are refused as with a
service that is down. The child exits when the tests' process does (it watches its stdin).

moto honours `If-None-Match: *` on PutObject and CompleteMultipartUpload (a 412), but it checks and
writes in two steps, so two requests in flight at once could both pass; this server hands moto one
request at a time, which makes its conditional writes atomic as S3's are. The racing tests thus
check that the store asks for exclusivity and reads the answer right, not S3's own atomicity.

`shared()` is one server for the whole test session; each test takes a bucket of its own (`bucket`).
"""

from __future__ import annotations

import atexit
import functools
import secrets
import selectors
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from typing import Any

START_S = 30  # a bound on waiting for the child, not a measurement


class S3Server:
    def __init__(self) -> None:
        self.process: subprocess.Popen[str] | None = None
        self.port = 0

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> S3Server:
        self.process = subprocess.Popen([sys.executable, "-P", __file__], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                        stderr=subprocess.DEVNULL, text=True)
        assert self.process.stdout is not None
        with selectors.DefaultSelector() as selector:
            selector.register(self.process.stdout, selectors.EVENT_READ)
            line = self.process.stdout.readline() if selector.select(START_S) else ""
        if not line.strip().isdigit():
            self.stop()
            raise RuntimeError(f"moto's S3 server did not start (it said {line!r})")
        self.port = int(line)
        return self

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def client(self) -> Any:
        """A plain boto3 client of this server (to look at what the store wrote)."""
        import boto3

        return boto3.client("s3", endpoint_url=self.url, region_name="us-east-1",
                            aws_access_key_id="test", aws_secret_access_key="test")

    def bucket(self) -> str:
        """A new bucket of its own."""
        name = f"test-{secrets.token_hex(6)}"
        self.client().create_bucket(Bucket=name)
        return name


@functools.cache
def shared() -> S3Server:
    """The session's server, started on first use, stopped when the tests' process exits."""
    server = S3Server().start()
    atexit.register(server.stop)
    return server


class _OneAtATime:
    """A WSGI app handed one request at a time (its whole answer made inside)."""

    def __init__(self, app: Callable[..., Iterable[bytes]]) -> None:
        self.app, self.lock = app, threading.Lock()

    def __call__(self, environ: dict[str, Any], start_response: Callable[..., Any]) -> list[bytes]:
        with self.lock:
            return list(self.app(environ, start_response))


def _serve() -> None:
    import logging
    import os

    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from werkzeug.serving import make_server

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    app = _OneAtATime(DomainDispatcherApplication(create_backend_app))
    server = make_server("127.0.0.1", 0, app, threaded=True, request_handler=MotoRequestHandler)
    threading.Thread(target=lambda: (sys.stdin.read(), os._exit(0)), daemon=True).start()  # parent gone: exit
    print(server.server_port, flush=True)
    server.serve_forever()


if __name__ == "__main__":
    _serve()
