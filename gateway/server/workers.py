"""`workers` > 1: N gateway processes on one listening socket, each embedded model's engine core started once by
the parent and shared by all of them; everything else (remote clients, caches, limits, stores) is each worker's."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import structlog
from pydantic import SecretStr

from engine import EngineSettings, SharedEngine, attach_shared, check_engine_settings, launch_shared
from engine.types import Engine
from gateway.app import create_app, tenants_of
from gateway.backends import modelfile
from gateway.backends.modelfile import ConfigError
from gateway.backends.startup import embedded_settings, prioritized
from gateway.pipeline.lifecycle import Lifecycle
from gateway.server.http import DrainingServer, server_config
from gateway.server.supervisor import SPAWN, STARTUP_FAILED, Supervisor, WorkerSeat, listen
from gateway.server.tls import ServerTLS
from gateway.settings import Reloadable, Settings
from gateway.telemetry import metrics
from gateway.telemetry.logs import configure
from gateway.tenancy.tenants import Tenants
from gateway.tenancy.tenants import read as read_keys

log = structlog.get_logger(__name__)
WORKER_HEADER = b"x-gateway-worker"
MULTIPROC_VARIABLE = "PROMETHEUS_MULTIPROC_DIR"  # read by prometheus_client when a worker imports it
STOP_MARGIN_S = 15  # beyond the drain: the workers' engines and stores closing


AppFactory = Callable[[Lifecycle, Tenants], Any]


def gateway_server(settings: Settings, make_app: AppFactory, announce: Callable[[], None] | None = None) -> DrainingServer:
    tls = ServerTLS(settings.tls) if settings.tls.enabled else None  # bad files stop us before the engine loads
    lifecycle = Lifecycle()
    tenants = tenants_of(settings)  # a bad keys file stops us here too
    app = make_app(lifecycle, tenants)
    config = server_config(app, settings, tls.uvicorn_options() if tls else None)
    reloadables: list[Reloadable] = [tls] if tls else []
    if tenants.enabled:
        reloadables.append(tenants)
    return DrainingServer(config, lifecycle, settings.drain_timeout_s, reloadables=reloadables, announce=announce)


class WorkerHeader:
    """`x-gateway-worker: <index>` on every answer, to tell which process answered."""

    def __init__(self, app: Any, index: int) -> None:
        self.app = app
        self.header = (WORKER_HEADER, str(index).encode())

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def marked(message: Any) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), self.header]}
            await send(message)

        await self.app(scope, receive, marked)


def serve_worker(seat: WorkerSeat, settings: Settings, make_app: AppFactory) -> int:
    configure(settings.log_level, settings.log_format)
    structlog.contextvars.bind_contextvars(worker=seat.index)
    metrics.aggregate_workers()
    server = gateway_server(settings, lambda lifecycle, tenants: WorkerHeader(make_app(lifecycle, tenants), seat.index),
                            announce=seat.announce)
    server.run(sockets=[seat.sock])
    return 0 if server.started else STARTUP_FAILED


@dataclass(frozen=True)
class WorkerPlan:
    settings: Settings
    seats: tuple[Any, ...]


def gateway_worker(seat: WorkerSeat, plan: WorkerPlan) -> int:
    def starter(settings: EngineSettings) -> Engine:
        """An embedded model's engine attached to its shared core, found by the engine settings (computed alike in the
        parent and the worker)."""
        for shared in plan.seats:
            if shared.settings == settings:
                return attach_shared(shared)
        raise ConfigError(f"no shared engine core for the model '{settings.served_model_name}'")

    return serve_worker(seat, plan.settings, lambda lifecycle, tenants: create_app(
        plan.settings, engine_starter=starter, lifecycle=lifecycle, tenants=tenants))


def worker_settings(settings: Settings) -> Settings:
    """One `key_id_secret` for all workers, drawn here when unset: each drawing its own, a key would have a bucket
    per worker in Redis, each allowing the whole limit."""
    if settings.key_id_secret is not None:
        return settings
    return settings.model_copy(update={"key_id_secret": SecretStr(secrets.token_hex(32))})


def shared_engines(settings: Settings, tenants: Tenants) -> dict[str, EngineSettings]:
    return embedded_settings(modelfile.load(settings), settings, prioritized(settings, tenants))


def refuse_unshared(settings: Settings, engines: dict[str, EngineSettings]) -> None:
    """What workers cannot share: limits and budgets counted in each worker's memory (each would allow the whole
    limit), and LoRA adapters (vLLM refuses runtime LoRA changes with several API servers too)."""
    if settings.keys_file is not None and settings.limits.redis_url is None:
        limited = [key_id for key_id, spec in read_keys(settings.keys_file).keys.items()
                   if spec.rpm or spec.tpm or spec.budget.day or spec.budget.month]
        if limited:
            raise ConfigError(f"workers > 1: the keys file sets limits or budgets ({', '.join(sorted(limited))}), "
                              "which need limits.redis_url to be counted across the workers")
    for name, engine in engines.items():
        if engine.enable_lora:
            raise ConfigError(f"workers > 1: model '{name}' has enable_lora; LoRA adapters need workers = 1")


@contextlib.contextmanager
def metrics_directory() -> Iterator[str]:
    """Every worker's metrics in files there, added up by any worker's /metrics."""
    with tempfile.TemporaryDirectory(prefix="llm-gateway-metrics-") as directory:
        os.environ[MULTIPROC_VARIABLE] = directory
        try:
            yield directory
        finally:
            os.environ.pop(MULTIPROC_VARIABLE, None)


def _interrupt(sig: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt(signal.Signals(sig).name)  # while the engine cores start: stop, cleaning up


def serve_workers(settings: Settings, worker: Callable[[WorkerSeat, WorkerPlan], int] = gateway_worker) -> int:
    configure(settings.log_level, settings.log_format)
    settings = worker_settings(settings)
    if settings.tls.enabled:
        ServerTLS(settings.tls)  # bad files stop us here, before any engine starts
    tenants = tenants_of(settings)
    create_app(settings, engine_check=check_engine_settings, tenants=tenants)  # refuses bad configuration; starts nothing
    engines = shared_engines(settings, tenants)
    refuse_unshared(settings, engines)
    supervisor: Supervisor | None = None
    cores: list[SharedEngine] = []
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        with metrics_directory(), contextlib.closing(listen(settings.host, settings.port)) as sock:
            for name, engine in engines.items():
                log.info("engine_starting", model=name, shared_by=settings.workers)
                cores.append(launch_shared(engine, settings.workers, SPAWN))
            plans = [WorkerPlan(settings, tuple(core.seat(i) for core in cores)) for i in range(settings.workers)]
            supervisor = Supervisor(worker, plans, sock, settings.drain_timeout_s + STOP_MARGIN_S)
            host, port = sock.getsockname()[:2]

            def ready() -> None:
                scheme = "https" if settings.tls.enabled else "http"
                log.info("listening", host=host, port=port, scheme=scheme, workers=settings.workers,
                         worker_pids=supervisor.pids if supervisor else [], engine_core_pids=[p for c in cores for p in c.pids])

            def spawned() -> None:
                for core in cores:
                    core.handed_over()

            def watch() -> None:
                for core in cores:
                    core.alive()

            return supervisor.run(on_ready=ready, on_tick=watch, on_spawned=spawned)
    except KeyboardInterrupt:
        log.info("stopped_while_starting")
        return STARTUP_FAILED
    finally:
        signal.signal(signal.SIGTERM, previous)
        for core in cores:
            core.shutdown()
