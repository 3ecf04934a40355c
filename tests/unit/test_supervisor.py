"""Worker processes on one listening socket (`gateway.server.supervisor`), with trivial worker
functions in place of the gateway: the socket handed over, signals forwarded, a dying worker taking
the others down. Also what `workers` > 1 refuses (`gateway.settings`, `gateway.server.workers`)."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError

from engine.config import EngineSettings
from gateway.backends.modelfile import ConfigError
from gateway.server.supervisor import STARTUP_FAILED, WORKER_DIED, Supervisor, listen
from gateway.server.workers import WORKER_HEADER, WorkerHeader, refuse_unshared
from gateway.settings import Settings
from tests.worker_mains import answer_index, die_after_start, never_start

STOP_S = 10


def ask(port: int) -> tuple[int, int]:
    with socket.create_connection(("127.0.0.1", port), timeout=5) as conn:
        index, pid = conn.recv(100).decode().split()
    return int(index), int(pid)


def test_workers_share_the_parents_socket_and_stop_on_sigterm() -> None:
    sock = listen("127.0.0.1", 0)
    port = sock.getsockname()[1]
    supervisor = Supervisor(answer_index, [None, None], sock, STOP_S)
    answers: set[tuple[int, int]] = set()

    def ready() -> None:
        for _ in range(200):
            answers.add(ask(port))
            if len(answers) == 2:
                break
        os.kill(os.getpid(), signal.SIGTERM)  # the parent's handler: forwarded to the workers

    with sock:
        status = supervisor.run(on_ready=ready)
    assert status == 0
    assert {index for index, _ in answers} == {0, 1}
    assert {pid for _, pid in answers} == set(supervisor.pids)
    assert os.getpid() not in supervisor.pids
    assert not any(worker.is_alive() for worker in supervisor.workers)


def test_sighup_is_forwarded_to_every_worker(tmp_path: Path) -> None:
    sock = listen("127.0.0.1", 0)
    supervisor = Supervisor(answer_index, [str(tmp_path)] * 2, sock, STOP_S)
    sent = False

    def tick() -> None:
        nonlocal sent
        if not sent:
            sent = True
            os.kill(os.getpid(), signal.SIGHUP)
        elif {p.name for p in tmp_path.iterdir()} == {"hup-0", "hup-1"}:
            os.kill(os.getpid(), signal.SIGTERM)

    with sock:
        assert supervisor.run(on_tick=tick) == 0
    assert {p.name for p in tmp_path.iterdir()} == {"hup-0", "hup-1"}


def test_a_worker_that_dies_stops_the_others_and_the_parent_fails() -> None:
    sock = listen("127.0.0.1", 0)
    supervisor = Supervisor(die_after_start, [None, None], sock, STOP_S)
    with sock:
        status = supervisor.run()
    assert status == WORKER_DIED
    assert [worker.exitcode for worker in supervisor.workers] == [0, 7]  # worker 0 was stopped, not killed


def test_a_worker_that_never_serves_is_a_failed_start() -> None:
    sock = listen("127.0.0.1", 0)
    supervisor = Supervisor(never_start, [None, None], sock, STOP_S)
    with sock:
        assert supervisor.run() == STARTUP_FAILED
    assert not any(worker.is_alive() for worker in supervisor.workers)


def test_listen_binds_port_zero_once() -> None:
    with listen("127.0.0.1", 0) as sock:
        port = sock.getsockname()[1]
        assert port > 0
        with pytest.raises(OSError, match="in use"):
            listen("127.0.0.1", port).close()


def test_in_memory_rate_limits_are_refused_with_workers() -> None:
    with pytest.raises(ValidationError, match=r"limits\.redis_url"):
        Settings(workers=2, rate_limit_rpm=10)
    with pytest.raises(ValidationError, match=r"limits\.redis_url"):
        Settings(workers=2, rate_limit_tpm=1000)
    assert Settings(workers=2, rate_limit_rpm=10, limits={"redis_url": "redis://127.0.0.1:1/0"}).workers == 2
    assert Settings(workers=1, rate_limit_rpm=10).workers == 1
    assert Settings(workers=2).workers == 2
    with pytest.raises(ValidationError):
        Settings(workers=0)


def test_keys_with_limits_or_budgets_need_redis_with_workers(tmp_path: Path) -> None:
    keys = tmp_path / "keys.yaml"
    keys.write_text("keys:\n  plain: {key: sk-a}\n  capped: {key: sk-b, budget: {day: 100}}\n")
    with pytest.raises(ConfigError, match="capped"):
        refuse_unshared(Settings(workers=2, keys_file=keys), {})
    refuse_unshared(Settings(workers=2, keys_file=keys, limits={"redis_url": "redis://127.0.0.1:1/0"}), {})
    keys.write_text("keys:\n  plain: {key: sk-a}\n")
    refuse_unshared(Settings(workers=2, keys_file=keys), {})


def test_lora_is_refused_with_workers() -> None:
    with pytest.raises(ConfigError, match="enable_lora"):
        refuse_unshared(Settings(workers=2), {"m": EngineSettings(enable_lora=True)})
    refuse_unshared(Settings(workers=2), {"m": EngineSettings()})


def test_the_worker_header_names_the_worker() -> None:
    async def app(scope: Any, receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": [(b"a", b"1")]})
        await send({"type": "http.response.body", "body": b"ok"})

    sent: list[Any] = []

    async def send(message: Any) -> None:
        sent.append(message)

    asyncio.run(WorkerHeader(app, 3)({"type": "http"}, None, send))
    assert sent[0]["headers"] == [(b"a", b"1"), (WORKER_HEADER, b"3")]
    assert sent[1] == {"type": "http.response.body", "body": b"ok"}
