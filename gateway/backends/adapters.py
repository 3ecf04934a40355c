"""LoRA adapters as models: each a registry `Backend` like any model, served by its base model's engine, and loaded
and unloaded while serving."""

from __future__ import annotations

import asyncio
import dataclasses
import re
import time
import unicodedata
from collections.abc import AsyncGenerator

import structlog

from engine import adapters
from engine.config import SamplingDefaults
from engine.errors import EngineError, EngineInvalidRequest
from engine.types import (
    AdapterLoad,
    Embeddings,
    EmbedRequest,
    Engine,
    EngineLoad,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    Tokenizer,
)
from gateway.backends.admission import Admission
from gateway.backends.registry import Backend, ModelRegistry, identity
from gateway.backends.versions import SEPARATOR
from gateway.errors import InvalidRequest, NotFound, ServiceUnavailable
from gateway.settings import merged

log = structlog.get_logger(__name__)
MAX_NAME = 256
# a name loaded while serving is a model id in logs and metrics, and one of the router page's
# comma-separated adapters (`telemetry.router`): a comma in it would read as two adapters there
_NAME = re.compile(rf"[^\s,]{{1,{MAX_NAME}}}")


class AdapterEngine:
    """The base's engine seen through an adapter: every generation names it. Counts its generations in flight so an
    unload can wait for them."""

    def __init__(self, base: Engine, name: str, path: str, defaults: SamplingDefaults | None = None) -> None:
        self.base = base
        self.name = name  # the adapter's name in the engine: its public id (vLLM's metrics label it so)
        self.path = path
        sampling = merged(base.info.sampling_defaults, defaults)
        self.info: ModelInfo = dataclasses.replace(base.info, name=name, root=path, sampling_defaults=sampling)
        self.tokenizer: Tokenizer = base.tokenizer
        self.in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        self.in_flight += 1
        self._idle.clear()
        try:
            async for output in self.base.generate(dataclasses.replace(request, adapter=self.name)):
                yield output
        finally:
            self.in_flight -= 1
            if not self.in_flight:
                self._idle.set()

    async def embed(self, request: EmbedRequest) -> Embeddings:
        raise EngineInvalidRequest(f"the adapter '{self.name}' generates; it does not embed", "model")

    async def abort(self, request_id: str) -> None:
        await self.base.abort(request_id)

    @property
    def healthy(self) -> bool:
        return self.base.healthy

    def load(self) -> EngineLoad:
        return self.base.load()  # one engine: the base's numbers (the router page counts it once)

    async def load_adapter(self, name: str, path: str) -> None:
        raise EngineInvalidRequest(f"'{self.name}' is an adapter: adapters load into a base model")

    async def unload_adapter(self, name: str) -> None:
        raise EngineInvalidRequest(f"'{self.name}' is an adapter: adapters unload from a base model")

    def adapter_load(self) -> AdapterLoad | None:
        return self.base.adapter_load()

    async def check_health(self) -> None:
        await self.base.check_health()

    async def shutdown(self) -> None:
        ...

    async def drained(self) -> None:
        await self._idle.wait()


def adapter_backend(name: str, base: Backend, path: str, weights: str, created: int, version: str | None = None,
                    fallback: tuple[str, ...] = (), defaults: SamplingDefaults | None = None,
                    admission: Admission | None = None) -> Backend:
    """The backend of an adapter of `base` whose files have the digest `weights` (`engine.adapters.digest`); unless
    it has its own, the base's admission: one engine, one bound."""
    assert base.engine is not None
    engine = AdapterEngine(base.engine, name, path, defaults)
    answers = identity(base=base.identity, weights=weights, sampling=engine.info.sampling_defaults)
    return Backend(name, admission or base.admission, engine, fallback, created=created, version=version, base=base.name,
                   identity=answers)


async def load_declared(registry: ModelRegistry) -> None:
    for backend in registry.backends.values():
        engine = backend.engine
        if isinstance(engine, AdapterEngine):
            await engine.base.load_adapter(engine.name, engine.path)
            log.info("adapter_loaded", model=backend.name, base=backend.base, path=engine.path)


class AdapterAdmin:
    """Loads and unloads adapters while serving, one change at a time. An unload leaves the registry first (new
    requests: 404), waits for those in flight, then leaves the engine."""

    def __init__(self, registry: ModelRegistry) -> None:
        self.registry = registry
        self._lock = asyncio.Lock()

    async def load(self, name: str, path: str, base: str | None = None) -> None:
        async with self._lock:
            if not name or SEPARATOR in name or not _NAME.fullmatch(name) or any(
                unicodedata.category(c) in ("Cc", "Cf", "Zl", "Zp", "Zs") for c in name
            ):
                raise InvalidRequest(f"'{name[:100]}' cannot name an adapter: give a name of at most {MAX_NAME} "
                                     f"characters without '{SEPARATOR}', commas, whitespace or control characters",
                                     "lora_name")
            if name in self.registry.public_names():
                raise InvalidRequest(f"The lora adapter '{name}' conflicts with a served model, alias or adapter.",
                                     "lora_name")
            base_backend = self._base(base)
            assert base_backend.engine is not None
            try:  # the files as the engine reads them next, read off the event loop
                weights = await asyncio.to_thread(adapters.digest, path)
                await base_backend.engine.load_adapter(name, path)
            except adapters.AdapterError as exc:
                raise InvalidRequest(f"the adapter '{name}': {exc}", "lora_path") from exc
            except EngineInvalidRequest as exc:
                raise InvalidRequest(exc.message, "lora_path") from exc
            except EngineError as exc:
                raise ServiceUnavailable(f"The model '{base_backend.name}' cannot load adapters now: {exc.message}") from exc
            self.registry.add(adapter_backend(name, base_backend, path, weights, int(time.time())))
            log.info("adapter_loaded", model=name, base=base_backend.name, path=path)

    def _base(self, base: str | None) -> Backend:
        if base is not None:
            found = self.registry.backends.get(base)
            if found is None or found.engine is None or found.base is not None:
                raise InvalidRequest(f"'{base}' is not an embedded model of this gateway", "base")
            return found
        serving = [b for b in self.registry.backends.values()
                   if b.base is None and b.engine is not None and b.engine.adapter_load() is not None]
        if len(serving) == 1:
            return serving[0]
        if not serving:
            raise InvalidRequest("No model here serves adapters: give a base model enable_lora (its engine settings)",
                                 "lora_name")
        names = ", ".join(sorted(b.name for b in serving))
        raise InvalidRequest(f"Several models serve adapters ({names}): name one as `base`", "base")

    async def unload(self, name: str) -> None:
        async with self._lock:
            backend = self.registry.backends.get(name)
            if backend is None or not isinstance(backend.engine, AdapterEngine):
                raise NotFound(f"The lora adapter '{name}' cannot be found.", "lora_name")
            users = self.registry.referrers(name)
            if users:
                raise InvalidRequest(f"The lora adapter '{name}' is a version or fallback of {', '.join(users)}: "
                                     "change the models file instead", "lora_name")
            self.registry.remove(name)  # new requests: 404; those in flight go on
            # shielded: a client that leaves does not leave the adapter half unloaded
            await asyncio.shield(self._unload(backend.engine))

    async def _unload(self, engine: AdapterEngine) -> None:
        started = time.perf_counter()
        await engine.drained()
        await engine.base.unload_adapter(engine.name)
        log.info("adapter_unloaded", model=engine.name, waited_s=round(time.perf_counter() - started, 3))
