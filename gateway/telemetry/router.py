"""The router's page (`GET /metrics/router`): the pod's load as an endpoint picker (llm-d, the Gateway API Inference
Extension) reads it. A picker takes one series of a family, so each family here has exactly one, the pod's,
formatted by hand from the engines' loads and the admission counters."""

from __future__ import annotations

import time
from collections.abc import Iterable

from engine.types import EngineLoad

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
WAITING = "vllm:num_requests_waiting"
RUNNING = "vllm:num_requests_running"
KV_CACHE_USAGE = "vllm:kv_cache_usage_perc"
CACHE_CONFIG = "vllm:cache_config_info"
LORA = "vllm:lora_requests_info"
SERIES = (WAITING, RUNNING, KV_CACHE_USAGE, CACHE_CONFIG, LORA)

_TEMPLATE = (
    f"# HELP {WAITING} Requests waiting: the engines' queues and the gateway's admission queues.\n"
    f"# TYPE {WAITING} gauge\n"
    f"{WAITING} {{waiting}}\n"
    f"# HELP {RUNNING} Requests in the engines' running batches.\n"
    f"# TYPE {RUNNING} gauge\n"
    f"{RUNNING} {{running}}\n"
    f"# HELP {KV_CACHE_USAGE} KV-cache usage of the fullest engine. 1 means 100 percent usage.\n"
    f"# TYPE {KV_CACHE_USAGE} gauge\n"
    f"{KV_CACHE_USAGE} {{kv}}\n"
    f"# HELP {CACHE_CONFIG} KV-cache configuration of the pod's engines.\n"
    f"# TYPE {CACHE_CONFIG} gauge\n"
    f'{CACHE_CONFIG}{{{{block_size="{{block_size}}",num_gpu_blocks="{{blocks}}"}}}} 1.0\n'
    f"# HELP {LORA} Running stats on LoRA requests.\n"
    f"# TYPE {LORA} gauge\n"
    f'{LORA}{{{{max_lora="{{max_lora}}",running_lora_adapters="{{running_lora}}",'
    f'waiting_lora_adapters="{{waiting_lora}}"}}}} {{now}}\n'
)


def page(loads: Iterable[EngineLoad], admission_waiting: int, now: float | None = None) -> bytes:
    """The exposition: waiting counts the engines' queues plus the gateway's admission queues; KV cache usage is the
    fullest engine's (a mean would hide a full one); block size the smallest, blocks and LoRA slots summed."""
    loads = list(loads)
    sizes = [load.block_size for load in loads if load.block_size]
    return _TEMPLATE.format(
        waiting=sum(load.waiting for load in loads) + admission_waiting,
        running=sum(load.running for load in loads),
        kv=float(max((load.kv_cache_usage for load in loads), default=0.0)),
        block_size=min(sizes, default=0),
        blocks=sum(load.num_blocks for load in loads),
        max_lora=sum(load.max_lora for load in loads),
        running_lora=_names({name for load in loads for name in load.running_lora_adapters}),
        waiting_lora=_names({name for load in loads for name in load.waiting_lora_adapters}),
        now=time.time() if now is None else now,
    ).encode()


def _names(adapters: set[str]) -> str:
    joined = ",".join(sorted(adapters))
    return joined.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
