"""A real redis-server for the cache tests (Debian's package; make test installs it).

It listens on a unix socket only (`--port 0` turns its TCP listener off), at a path of its own: no
port to pick, so no other process can take its address while it starts, and a Redis stopped and
started again (`stop`, `start`) is back at the same address (`url`, unix:///PATH), which the
gateway's Redis clients take as they take redis://host:port.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import tempfile
import time
import weakref
from pathlib import Path

START_S = 60  # a bound on waiting for redis-server, not a measurement


class RedisServer:
    def __init__(self, directory: Path, appendfsync: str | None = None) -> None:
        """`appendfsync` (always, everysec, no): AOF on with that policy, as docs/deployment.md asks of
        the batch lane's store (the benchmarks measure it so); None: no persistence (the tests)."""
        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed: run `make system-deps`")
        self.binary, self.directory, self.appendfsync = binary, directory, appendfsync
        # a short folder of its own: a unix socket's path is at most 107 bytes (pytest's folders run long)
        folder = tempfile.mkdtemp(prefix="redis-")
        weakref.finalize(self, shutil.rmtree, folder, ignore_errors=True)
        self.socket_path = Path(folder) / "redis.sock"
        self.process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}?db=0"

    def start(self) -> RedisServer:
        command = [self.binary, "--port", "0", "--unixsocket", str(self.socket_path), "--unixsocketperm", "700",
                   "--save", "", "--dir", str(self.directory),
                   *(["--appendonly", "yes", "--appendfsync", self.appendfsync] if self.appendfsync else ["--appendonly", "no"])]
        log_path = self.directory / "redis.log"
        with open(log_path, "w") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.process.returncode}:\n{log_path.read_text()[-2000:]}")
            try:
                with socket.socket(socket.AF_UNIX) as sock:
                    sock.settimeout(0.2)
                    sock.connect(str(self.socket_path))
                    return self
            except OSError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start:\n{log_path.read_text()[-2000:]}")

    def stop(self) -> None:
        if self.process is not None:
            self.process.terminate()
            self.process.wait(timeout=10)
            self.process = None
