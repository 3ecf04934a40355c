"""Starting and stopping what answers: the registry from the models file, the structured-output warm-up, and the stop
after the drain."""

from __future__ import annotations

import time
from collections.abc import Callable

import structlog

from engine import adapters, check_engine_settings, start_engine, start_grammar_check
from engine.config import EngineSettings
from engine.types import Engine, GenerationRequest, GrammarCheck, SamplingOptions
from gateway.backends.adapters import adapter_backend
from gateway.backends.admission import Admission
from gateway.backends.modelfile import ConfigError, ModelsFile, catalog
from gateway.backends.registry import Backend, ModelRegistry, Split, identity
from gateway.backends.upstream import Upstream
from gateway.settings import Settings
from gateway.tenancy.tenants import Tenants

log = structlog.get_logger(__name__)

EngineStarter = Callable[[EngineSettings], Engine]
EngineCheck = Callable[[EngineSettings], None]
GrammarStarter = Callable[[Engine, int, int], GrammarCheck | None]  # (engine, workers, verdicts kept)
start_embedded: EngineStarter = start_engine


def check_embedded(models: ModelsFile, settings: Settings, check: EngineCheck = check_engine_settings) -> None:
    """Every embedded model's engine settings against its model and the platform, before anything starts: a
    ConfigError naming the model and setting."""
    for spec in models.models:
        if spec.kind != "embedded":
            continue
        try:
            check(spec.engine_settings(settings.engine))
        except ValueError as exc:  # EngineConfigError, unknown engine arguments
            raise ConfigError(f"model '{spec.id}': {exc}") from exc


def embedded_settings(models: ModelsFile, settings: Settings, prioritized: bool = False) -> dict[str, EngineSettings]:
    return {spec.id: scheduling(spec.engine_settings(settings.engine), prioritized)
            for spec in models.models if spec.kind == "embedded"}


def build_registry(
    models: ModelsFile, settings: Settings, start: EngineStarter, grammar: GrammarStarter = start_grammar_check,
    prioritized: bool = False,
) -> ModelRegistry:
    """The backends of the models file, embedded engines started (with grammar compiler processes when asked), under
    priority scheduling when `prioritized` and their policy is auto."""
    backends: dict[str, Backend] = {}
    splits: dict[str, Split] = {}
    aliases: dict[str, str] = {}
    created = int(time.time())
    # the gateway's settings that change an answer: a request's max_tokens when it sends none
    answers = {"default_max_tokens": settings.default_max_tokens, "most": settings.max_output_tokens_per_request}
    for spec in models.models:
        aliases.update({alias: spec.id for alias in spec.aliases})
        if spec.kind == "split":
            splits[spec.id] = Split(spec.id, list(spec.versions.items()), spec.sticky, created)
            continue
        if spec.kind == "adapter":
            continue  # once its base is there, below
        if spec.kind == "remote":
            admission = Admission(spec.id, spec.admission or settings.admission)
            assert spec.url is not None
            upstream = Upstream(spec.id, spec.url, spec.upstream_model or spec.name, spec.api_key, spec.timeout_s,
                                spec.connect_timeout_s, spec.max_connections, log_bodies=settings.log_prompts)
            remote = identity(url=spec.url, model=upstream.upstream_model, defaults=spec.defaults, **answers)
            backends[spec.id] = Backend(spec.id, admission, upstream, tuple(spec.fallback), created=created,
                                        version=spec.version, defaults=spec.defaults, identity=remote)
            continue
        log.info("engine_starting", model=spec.id)
        engine_settings = scheduling(spec.engine_settings(settings.engine), prioritized)
        engine = start(engine_settings)
        admission = Admission(spec.id, spec.admission or settings.admission, engine)
        structured = settings.structured_output
        checker = grammar(engine, structured.compile_workers, structured.compile_verdicts)
        log.info("sampling_defaults", model=spec.id, **engine.info.sampling_defaults.model_dump(exclude_none=True))
        backends[spec.id] = Backend(spec.id, admission, engine, tuple(spec.fallback), checker, created, spec.version,
                                    identity=embedded_identity(engine_settings, engine, answers))
    for spec in models.models:
        if spec.kind == "adapter":
            assert spec.base is not None
            assert spec.path is not None
            base = backends[spec.base].engine
            assert base is not None
            own = Admission(spec.id, spec.admission, base) if spec.admission else None
            try:
                weights = adapters.digest(spec.path)
            except adapters.AdapterError as exc:  # read at the check, gone or changed since
                raise ConfigError(f"adapter '{spec.id}': {exc}") from exc
            backends[spec.id] = adapter_backend(spec.id, backends[spec.base], spec.path, weights, created,
                                                spec.version, tuple(spec.fallback), spec.defaults, own)
    return ModelRegistry(backends, splits, aliases, catalog(models))


def embedded_identity(settings: EngineSettings, engine: Engine, answers: dict[str, int | None]) -> str:
    """The engine's weights and what changes its answers: the model, how its weights are computed (dtype,
    quantization), its context, its chat and prompt handling, and the sampling defaults it applies."""
    info = engine.info
    return identity(
        model=info.root or settings.model, task=info.task, max_model_len=info.max_model_len,
        sampling=info.sampling_defaults, **answers,
        **settings.model_dump(include={"dtype", "quantization", "kv_cache_dtype", "disable_sliding_window",
                                       "generation_config", "prompt_special_tokens", "seed", "engine_args"}),
    )


def prioritized(settings: Settings, tenants: Tenants) -> bool:
    """Whether requests have priorities for the engines to order by: keys with classes, or batches run here. The one
    decision, for this process's engines and the workers' shared cores."""
    return tenants.prioritized or settings.batches.enabled


def scheduling(engine: EngineSettings, prioritized: bool) -> EngineSettings:
    if engine.scheduling_policy != "auto":
        return engine
    return engine.model_copy(update={"scheduling_policy": "priority" if prioritized else "fcfs"})


async def warm_up(name: str, engine: Engine) -> None:
    """One tiny JSON-constrained generation, so the grammar machinery is compiled before the first request."""
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
        if backend.grammar is not None:
            await backend.grammar.close()
        log.info("backend_shutdown", model=name)
        await backend.generator.shutdown()  # an adapter's does nothing: its engine is its base's
