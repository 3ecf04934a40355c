"""The app factory: the ASGI app and the lifespan that starts the models, stores and batch runner and stops them after
the drain. Bad configuration is refused here, before anything starts."""

from __future__ import annotations

import asyncio
import contextlib
import gc
from collections.abc import AsyncIterator, Iterator

import structlog
from opentelemetry.sdk.trace.export import SpanExporter

from engine import start_grammar_check
from gateway.apis import takeover
from gateway.apis.application import App, application
from gateway.apis.batches.batches_runner import BatchRunner
from gateway.apis.routes import TABLE
from gateway.backends import modelfile
from gateway.backends.adapters import load_declared
from gateway.backends.startup import (
    EngineCheck,
    EngineStarter,
    GrammarStarter,
    build_registry,
    check_embedded,
    prioritized,
    start_embedded,
    stop,
    warm_up,
)
from gateway.guards.guarding import Guards
from gateway.mcp.servers import McpServers
from gateway.middleware.stack import stack
from gateway.pipeline.lifecycle import Lifecycle
from gateway.pipeline.state import GatewayState
from gateway.settings import Settings
from gateway.stores.backends import open_stores
from gateway.stores.cache import ResponseCache, make_backend
from gateway.stores.redis import RedisPools
from gateway.stores.responses import ResponseStore, make_store_backend
from gateway.stores.streams import make_stream_store
from gateway.telemetry import metrics
from gateway.telemetry.tracing import Tracing
from gateway.tenancy.keys import authenticator_of
from gateway.tenancy.quota import Quota
from gateway.tenancy.tenants import Tenants

log = structlog.get_logger(__name__)


@contextlib.contextmanager
def serving_heap(freeze: bool, young_threshold: int) -> Iterator[None]:
    """The garbage collector as the gateway serves (why: the settings `freeze_startup_heap` and `gc_young_threshold`),
    put back when serving ends."""
    threshold = gc.get_threshold()
    if freeze:
        gc.collect()
        gc.freeze()
    if young_threshold:
        gc.set_threshold(young_threshold, *threshold[1:])
    try:
        yield
    finally:
        gc.set_threshold(*threshold)
        if freeze:
            gc.unfreeze()


def tenants_of(settings: Settings) -> Tenants:
    return Tenants(settings.keys_file, settings.rate_limit_rpm, settings.rate_limit_tpm, settings.keys_reload_interval_s)


def create_app(settings: Settings, engine_starter: EngineStarter = start_embedded, lifecycle: Lifecycle | None = None,
               engine_check: EngineCheck | None = None, tenants: Tenants | None = None,
               trace_exporter: SpanExporter | None = None,
               grammar_starter: GrammarStarter = start_grammar_check) -> App:
    """`tenants`: the keys file, when the caller reloads it (the server, on SIGHUP); else read here. `trace_exporter`:
    where spans go (tests). `grammar_starter`: each embedded model's structured-output compiler (tests: a fake)."""
    models = modelfile.load(settings)
    guards = Guards.load(settings.guards_file, modelfile.guard_profiles(models))
    lifecycle = lifecycle or Lifecycle()
    tenants = tenants or tenants_of(settings)
    mcp = McpServers(settings.mcp)
    tenants.check(modelfile.public_names(models), frozenset(guards.profiles),
                  {label: server.url for label, server in mcp.by_label.items()})
    guards.key_profile = tenants.guard_profile  # a key's profile in the keys file comes first
    pools = RedisPools()  # one connection pool per Redis address: the cache, the store and the limits share it
    quota = Quota(settings.limits, pools)
    cache_backend = make_backend(settings.cache, pools)
    if engine_check is not None:  # last: it imports vllm and reads the models
        check_embedded(models, settings, engine_check)
    store_backend = make_store_backend(settings.cache, pools)
    tracing = Tracing(settings.tracing, trace_exporter) if settings.tracing.enabled else None
    authenticator = authenticator_of(settings, tenants)

    @contextlib.asynccontextmanager
    async def lifespan(app: object) -> AsyncIterator[dict[str, GatewayState]]:
        registry = build_registry(models, settings, engine_starter, grammar_starter, prioritized(settings, tenants))
        cache = ResponseCache(cache_backend)
        responses = ResponseStore(store_backend)
        streams = make_stream_store(settings.cache, settings.streams, pools)
        runner: BatchRunner | None = None
        files, batches = open_stores(settings, pools)
        try:
            await load_declared(registry)
            metrics.export_adapter_load(lambda: [engine.adapter_load() for _, engine in registry.engines()])
            if settings.warmup:
                for name, engine in registry.engines():
                    await warm_up(name, engine)
            state = GatewayState(settings, registry, lifecycle, quota, cache, guards, responses, tenants,
                                 files, batches, authenticator, mcp=mcp,
                                 streams=streams)
            streams.continuation = takeover.continuation(state)  # a dead replica's streams go on here
            if settings.batches.enabled:  # pending batches resumed, once the models are up
                runner = BatchRunner(state, state.batches)
                runner.start()
                state.batch_runner = runner
            log.info("ready", models=sorted(registry.backends), splits=sorted(registry.splits), aliases=sorted(registry.aliases))
            with serving_heap(settings.freeze_startup_heap, settings.gc_young_threshold):
                yield {"gateway": state}
        finally:
            lifecycle.start_drain()
            if runner is not None:
                await runner.stop()  # lines in flight cancelled (they run again after a restart), leases freed
            await responses.aclose()  # background responses stop before their engines do
            await streams.aclose()  # their logs' last events and end markers written
            await stop(registry)
            if cache.backend is not None:
                await cache.backend.aclose()
            await guards.aclose()
            await files.aclose()
            await batches.aclose()
            await quota.aclose()
            await pools.aclose()
            if tracing is not None:
                await asyncio.to_thread(tracing.provider.shutdown)  # the last batch exported (bounded by tracing.export_timeout_s)

    return application(stack(settings, lifecycle, quota, tenants, TABLE, tracing, authenticator), lifespan)
