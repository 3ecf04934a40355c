"""The engine's load as a request router reads it, kept current by a stat logger of vLLM's so that reading it costs
nothing."""

from __future__ import annotations

import time

from vllm.config import VllmConfig
from vllm.v1.engine import FinishReason
from vllm.v1.metrics.loggers import StatLoggerBase
from vllm.v1.metrics.stats import IterationStats, MultiModalCacheStats, SchedulerStats

from engine.types import EngineLoad

RECENT = 2 / (20 + 1)  # the weight of one finished request in the engine's time per request: over about 20
CUT_SHORT = (FinishReason.ABORT, FinishReason.ERROR)  # their time is not what a request takes


def _averaged(average: float | None, seconds: float) -> float:
    return seconds if average is None else average + RECENT * (seconds - average)


class LoadRecorder:
    """The engine's `EngineLoad`, kept current by a stat logger of vLLM's (`factory`: once per engine core;
    data-parallel ranks added up). vLLM's Prometheus logger keeps only the last started engine's gauges, so with
    several models these are the only per-engine numbers."""

    def __init__(self) -> None:
        self.current = EngineLoad()
        self._ranks: dict[int, EngineLoad] = {}
        # engine requests per LoRA adapter (vLLM's scheduler counts them), per rank, and when last seen
        self._adapters: dict[int, tuple[dict[str, int], dict[str, int]]] = {}
        self.adapters_updated = 0.0
        self.request_s: float | None = None  # `EngineLoad.request_s`, every rank's requests in one average
        self.first_token_s: float | None = None  # `EngineLoad.first_token_s`, the same way

    def finished(self, seconds: float, first_token_s: float) -> None:
        """A request finished after `seconds` in the engine, its first token after `first_token_s`."""
        self.request_s = _averaged(self.request_s, seconds)
        self.first_token_s = _averaged(self.first_token_s, first_token_s)

    def adapters(self) -> tuple[dict[str, int], dict[str, int]]:
        """Engine requests running and waiting per adapter, every rank's added up."""
        running: dict[str, int] = {}
        waiting: dict[str, int] = {}
        for ranked_running, ranked_waiting in self._adapters.values():
            for name, count in ranked_running.items():
                running[name] = running.get(name, 0) + count
            for name, count in ranked_waiting.items():
                waiting[name] = waiting.get(name, 0) + count
        return running, waiting

    def update_adapters(self, rank: int, running: dict[str, int], waiting: dict[str, int]) -> None:
        self._adapters[rank] = (running, waiting)
        self.adapters_updated = time.time()

    def factory(self, vllm_config: VllmConfig, engine_index: int = 0) -> StatLoggerBase:
        return _LoadLogger(self, vllm_config, engine_index)

    def update(self, rank: int, load: EngineLoad) -> None:
        self._ranks[rank] = load
        if len(self._ranks) == 1:
            self.current = load
            return
        loads = list(self._ranks.values())
        self.current = EngineLoad(  # (request_s: the recorder's, every rank's in one)
            running=sum(x.running for x in loads),
            waiting=sum(x.waiting for x in loads),
            kv_cache_usage=max(x.kv_cache_usage for x in loads),
            block_size=load.block_size,
            num_blocks=sum(x.num_blocks for x in loads),
            max_lora=load.max_lora,
            running_lora_adapters=tuple(sorted({a for x in loads for a in x.running_lora_adapters})),
            waiting_lora_adapters=tuple(sorted({a for x in loads for a in x.waiting_lora_adapters})),
            request_s=self.request_s,
            first_token_s=self.first_token_s,
            batch=sum(x.batch for x in loads),
        )


class _LoadLogger(StatLoggerBase):  # type: ignore[misc]  # vLLM is Any to mypy (pyproject)
    """vLLM's stat logger interface (called on the event loop, per engine step's outputs) writing
    one engine core's scheduler numbers into a `LoadRecorder`."""

    def __init__(self, recorder: LoadRecorder, vllm_config: VllmConfig, engine_index: int = 0) -> None:
        self._recorder = recorder
        self._config = vllm_config
        self._rank = engine_index
        self._block_size = self._num_blocks = 0
        lora = vllm_config.lora_config
        self._max_lora = lora.max_loras if lora is not None else 0
        self._batch = int(vllm_config.scheduler_config.max_num_seqs)

    def log_engine_initialized(self) -> None:  # the KV cache is sized by now
        cache = self._config.cache_config
        self._block_size = int(cache.block_size or 0)
        self._num_blocks = int(cache.num_gpu_blocks or 0)
        load = EngineLoad(block_size=self._block_size, num_blocks=self._num_blocks, max_lora=self._max_lora,
                          batch=self._batch)
        self._recorder.update(self._rank, load)

    def record(
        self,
        scheduler_stats: SchedulerStats | None,
        iteration_stats: IterationStats | None,
        mm_cache_stats: MultiModalCacheStats | None = None,
        engine_idx: int = 0,
    ) -> None:
        for done in iteration_stats.finished_requests if iteration_stats is not None else ():
            seconds = done.queued_time + done.inference_time  # the engine core's timestamps
            # within the front's own span of it (a timestamp the core did not record reads as 0)
            if done.finish_reason not in CUT_SHORT and 0 < seconds <= done.e2e_latency:
                self._recorder.finished(seconds, min(seconds, done.queued_time + done.prefill_time))
        if scheduler_stats is None:
            return
        stats = scheduler_stats
        if self._max_lora:
            self._recorder.update_adapters(self._rank, dict(stats.running_lora_adapters), dict(stats.waiting_lora_adapters))
        self._recorder.update(self._rank, EngineLoad(
            running=stats.num_running_reqs,
            # as vllm:num_requests_waiting: waiting for capacity and deferred
            waiting=stats.num_waiting_reqs + stats.num_skipped_waiting_reqs,
            kv_cache_usage=stats.kv_cache_usage,
            block_size=self._block_size,
            num_blocks=self._num_blocks,
            max_lora=self._max_lora,
            running_lora_adapters=tuple(stats.running_lora_adapters),
            waiting_lora_adapters=tuple(stats.waiting_lora_adapters),
            request_s=self._recorder.request_s,
            first_token_s=self._recorder.first_token_s,
            batch=self._batch,
        ))
