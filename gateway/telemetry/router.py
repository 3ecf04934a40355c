"""The router's page (`GET /metrics/router`): the pod's load as an endpoint picker (llm-d, the Gateway API Inference
Extension) reads it. A picker takes one series of a family, so each family here has exactly one, the pod's, made from
the engines' loads and the admission counters."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from engine.types import EngineLoad

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"  # the text format pickers read
SERIES = ("vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
          "vllm:cache_config_info", "vllm:lora_requests_info")


class _Page(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        return iter(self.families)


def _gauge(name: str, text: str, value: float, **labels: str) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, text, labels=list(labels))
    family.add_metric(list(labels.values()), value)
    return family


def page(loads: Iterable[EngineLoad], admission_waiting: int, now: float | None = None) -> bytes:
    """The exposition: waiting counts the engines' queues plus the gateway's admission queues; KV cache usage is the
    fullest engine's (a mean would hide a full one); block size the smallest, blocks and LoRA slots summed."""
    loads = list(loads)
    waiting, running, kv, config, lora = SERIES
    return generate_latest(_Page([
        _gauge(waiting, "Requests waiting: the engines' queues and the gateway's admission queues.",
               sum(load.waiting for load in loads) + admission_waiting),
        _gauge(running, "Requests in the engines' running batches.", sum(load.running for load in loads)),
        _gauge(kv, "KV-cache usage of the fullest engine. 1 means 100 percent usage.",
               max((load.kv_cache_usage for load in loads), default=0.0)),
        _gauge(config, "KV-cache configuration of the pod's engines.", 1.0,
               block_size=str(min((load.block_size for load in loads if load.block_size), default=0)),
               num_gpu_blocks=str(sum(load.num_blocks for load in loads))),
        _gauge(lora, "Running stats on LoRA requests.", time.time() if now is None else now,
               max_lora=str(sum(load.max_lora for load in loads)),
               running_lora_adapters=",".join(sorted({name for load in loads for name in load.running_lora_adapters})),
               waiting_lora_adapters=",".join(sorted({name for load in loads for name in load.waiting_lora_adapters}))),
    ]))
