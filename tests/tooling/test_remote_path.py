"""benchmarks.remote_path's targets (issue 43): each HTTP server, engine and worker count serves the gateway by the
command that RESULTS.md's server and workers tables name."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.remote_path import gateway, parse


@pytest.mark.parametrize(("server", "upstream", "workers", "expected"), [
    ("uvicorn", "http://127.0.0.1:1/v1", 1, ["-m", "gateway", "serve", "--workers", "1"]),
    ("uvicorn", "http://127.0.0.1:1/v1", 2, ["-m", "gateway", "serve", "--workers", "2"]),
    ("uvicorn", None, 1, ["-m", "benchmarks.echo_engine", "--name", "bare"]),
    ("uvicorn", None, 2, ["-m", "benchmarks.workers", "echo-workers", "2"]),
    ("granian", "http://127.0.0.1:1/v1", 1, ["-m", "benchmarks.remote_path", "granian", "--engine", "remote",
                                              "--workers", "1"]),
    ("granian", None, 2, ["-m", "benchmarks.remote_path", "granian", "--engine", "echo", "--workers", "2"]),
])
def test_each_target_is_served_by_its_command(tmp_path: Path, server: str, upstream: str | None, workers: int,
                                               expected: list[str]) -> None:
    proc = gateway("g", Path("."), upstream, tmp_path, server, ("cert.pem", "key.pem"), workers)
    assert proc.command[2:-2] == expected
    assert proc.command[-2] == "--port"
    assert ("GATEWAY_MODELS_FILE" in proc.env) == (upstream is not None)
    assert proc.env["GATEWAY_TLS__CERT_FILE"] == "cert.pem"
    assert proc.base_url.startswith("https://")


def test_defaults_are_the_remote_path_on_uvicorn_with_one_worker() -> None:
    args = parse([])
    assert (args.servers, args.engine, args.workers, args.tls) == (["uvicorn"], "remote", [1], False)
