"""Starting and stopping what answers: the registry built from the models file (embedded engines
started, remote upstreams connected), the structured-output warm-up, and the stop after the drain.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from engine import start_engine
from engine.config import EngineSettings
from engine.types import Engine, GenerationRequest, SamplingOptions
from gateway.backends.admission import Admission
from gateway.backends.modelfile import ModelsFile
from gateway.backends.registry import Backend, ModelRegistry, Split
from gateway.backends.upstream import Upstream
from gateway.settings import Settings

log = structlog.get_logger(__name__)

EngineStarter = Callable[[EngineSettings], Engine]


def start_embedded(settings: EngineSettings) -> Engine:
    """The real engine (`engine.start_engine` imports vllm only when a model is started)."""
    return start_engine(settings)


def build_registry(models: ModelsFile, settings: Settings, start: EngineStarter) -> ModelRegistry:
    backends: dict[str, Backend] = {}
    splits: dict[str, Split] = {}
    aliases: dict[str, str] = {}
    created = int(time.time())
    for spec in models.models:
        aliases.update({alias: spec.name for alias in spec.aliases})
        if spec.kind == "split":
            splits[spec.name] = Split(spec.name, list(spec.versions.items()), spec.sticky, created)
            continue
        admission = Admission(spec.name, spec.admission or settings.admission)
        backend = Backend(spec.name, admission, tuple(spec.fallback), created=created)
        if spec.kind == "remote":
            assert spec.url is not None
            backend.upstream = Upstream(spec.name, spec.url, spec.upstream_model or spec.name, spec.api_key,
                                        spec.timeout_s, spec.connect_timeout_s)
        else:
            log.info("engine_starting", model=spec.name)
            backend.engine = start(spec.engine_settings(settings.engine))
        backends[spec.name] = backend
    return ModelRegistry(backends, splits, aliases)


async def warm_up(name: str, engine: Engine) -> None:
    """One tiny JSON-constrained generation: compiles the structured-output grammar machinery
    (embedding models have none)."""
    if engine.info.task != "generate":
        return
    started = time.perf_counter()
    prompt = engine.tokenizer.encode("{", add_special_tokens=False)
    request = GenerationRequest(f"warmup-{name}", prompt, SamplingOptions(max_tokens=2, json_object=True))
    async for _ in engine.generate(request):
        pass
    log.info("warmed_up", model=name, seconds=round(time.perf_counter() - started, 1))


async def stop(registry: ModelRegistry) -> None:
    for name, backend in registry.backends.items():
        if backend.engine is not None:
            log.info("engine_shutdown", model=name)
            await backend.engine.shutdown()
        if backend.upstream is not None:
            await backend.upstream.aclose()
