"""One vLLM engine core shared by several gateway worker processes, the way `vllm serve
--api-server-count N` shares it (vllm/entrypoints/cli/serve.py `run_multi_api_server`).

In the parent (`SharedCore`): one pair of ZMQ listeners per worker is bound
(`bind_engine_zmq_listeners`), then the engine core process(es) are started and their start-up
awaited (`launch_core_engines`); the core connects to every worker's pair. Each worker receives its
`CoreSeat` (addresses, the listening sockets themselves, its index) and makes its own AsyncLLM client
over it (`attach`, `AsyncLLM.from_vllm_config(client_addresses=..., client_count=...,
client_index=...)`): it tokenizes and detokenizes its own requests, and the core sends each worker
the outputs of the requests it sent.

A client of a core it did not start cannot see that core's process (vLLM watches it only in the
process that started it), so the parent watches (`SharedCore.alive`) and, when the core dies, sets
the seat's `dead` event: every worker then marks its client dead as vLLM's own monitor does
(`EngineDeadError` for requests in flight and every later one; the health checks fail).

What cannot be shared: vLLM sends the core's scheduler statistics (requests running and waiting, KV
cache use: `Engine.load`, the `vllm:` gauges) to client 0 only; the other workers' are zeros.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from dataclasses import dataclass
from multiprocessing.context import BaseContext
from typing import Any

from vllm import AsyncEngineArgs
from vllm.usage.usage_lib import UsageContext
from vllm.v1.engine.async_llm import AsyncLLM
from vllm.v1.engine.utils import CoreEngineProcManager, bind_engine_zmq_listeners, launch_core_engines
from vllm.v1.executor import Executor

from engine.config import EngineSettings
from engine.load import LoadRecorder
from engine.types import Engine
from engine.vllm_engine import OTLP_PROTOCOL_VARIABLE, VLLMEngine, engine_args

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class CoreSeat:
    """One worker's way to a shared engine core; passed to the worker process when it is started
    (its sockets and event are inherited then, and only then)."""

    settings: EngineSettings  # the model's engine settings, as the worker computes them too
    addresses: dict[str, Any]  # vLLM's client_addresses: input/output address and listener socket
    count: int
    index: int
    dead: Any  # a multiprocessing Event: set by the parent when the core died


def _args(settings: EngineSettings, count: int, rank: int) -> AsyncEngineArgs:
    # vLLM's fields for API processes sharing one core (its own API server sets them so too): a
    # seam, docs/development.md "Seams"; rank -1 is the parent, which runs no client
    args = dataclasses.replace(engine_args(settings), _api_process_count=count, _api_process_rank=rank)
    if args.otlp_traces_endpoint is not None:
        os.environ.setdefault(OTLP_PROTOCOL_VARIABLE, "http/protobuf")
    return args


class SharedCore:
    """The engine core(s) of one embedded model, started for `clients` worker processes."""

    def __init__(self, settings: EngineSettings, clients: int, context: BaseContext) -> None:
        args = _args(settings, clients, -1)
        config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        self._settings = settings
        self._clients = clients
        self._listeners = bind_engine_zmq_listeners(config, clients)
        self._dead = context.Event()
        self._stopping = False
        try:
            with launch_core_engines(
                config, Executor.get_class(config), not args.disable_log_stats, self._listeners.addresses
            ) as launch:
                pass  # on leaving, the cores' start-up (model load, KV cache) is awaited
        except BaseException:
            self._listeners.cleanup()
            raise
        self._launch = launch
        stats = launch.coordinator.get_stats_publish_address() if launch.coordinator else None
        self._stats_address = stats

    @property
    def pids(self) -> list[int]:
        manager = self._launch.engine_manager
        if not isinstance(manager, CoreEngineProcManager):
            return []
        return [proc.pid for proc in manager.processes if proc.pid is not None]

    def seat(self, index: int) -> CoreSeat:
        inputs, outputs = self._listeners.inputs[index], self._listeners.outputs[index]
        addresses: dict[str, Any] = {
            "input_address": inputs.address, "output_address": outputs.address,
            "input_listener": inputs.socket, "output_listener": outputs.socket,
        }
        if self._stats_address is not None:
            addresses["stats_update_address"] = self._stats_address
        return CoreSeat(self._settings, addresses, self._clients, index, self._dead)

    def handed_over(self) -> None:
        """The workers have their listeners (started with their seats): the parent's copies close."""
        for listener in (*self._listeners.inputs, *self._listeners.outputs):
            listener.close()

    def alive(self) -> bool:
        """False once a core process has exited (then the workers are told, once)."""
        manager = self._launch.engine_manager
        gone = isinstance(manager, CoreEngineProcManager) and bool(manager.finished_procs())
        if gone and not self._stopping and not self._dead.is_set():
            log.error("engine core of %s exited: every worker's engine is dead", self._settings.served_model_name)
            self._dead.set()
        return not gone

    def shutdown(self) -> None:
        self._stopping = True
        manager = self._launch.engine_manager
        if manager is not None:
            manager.shutdown()
        if self._launch.coordinator is not None:
            self._launch.coordinator.shutdown()
        self._listeners.cleanup()
        self._listeners.inputs.clear()  # (its __del__ would clean up again, late in the interpreter's exit)
        self._listeners.outputs.clear()


def attach(seat: CoreSeat) -> Engine:
    """In a worker: the embedded engine as a client of the shared core (the same `VLLMEngine`)."""
    args = _args(seat.settings, seat.count, seat.index)
    config = args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
    recorder = LoadRecorder()
    llm = AsyncLLM.from_vllm_config(
        config, usage_context=UsageContext.OPENAI_API_SERVER, stat_loggers=[recorder.factory],
        disable_log_stats=args.disable_log_stats, client_addresses=dict(seat.addresses),
        client_count=seat.count, client_index=seat.index,
    )
    _watch(llm, seat.dead)
    return VLLMEngine.over(llm, seat.settings, str(args.model), recorder)


def _watch(llm: AsyncLLM, dead: Any) -> None:
    """When the parent says the core died: the client dead, as vLLM's own monitor makes it
    (`MPClient.start_engine_core_monitor`): requests waiting on it get EngineDeadError."""

    def wait() -> None:
        dead.wait()
        client = llm.engine_core
        client.resources.engine_dead = True
        client.shutdown()

    threading.Thread(target=wait, name="SharedCoreMonitor", daemon=True).start()
