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
    running = waiting = blocks = max_lora = 0
    kv = 0.0
    block_size = 0
    running_lora: set[str] = set()
    waiting_lora: set[str] = set()
    for load in loads:
        running += load.running
        waiting += load.waiting
        kv = max(kv, load.kv_cache_usage)
        blocks += load.num_blocks
        if load.block_size and (not block_size or load.block_size < block_size):
            block_size = load.block_size
        max_lora += load.max_lora
        running_lora.update(load.running_lora_adapters)
        waiting_lora.update(load.waiting_lora_adapters)
    return _TEMPLATE.format(
        waiting=waiting + admission_waiting,
        running=running,
        kv=float(kv),
        block_size=block_size,
        blocks=blocks,
        max_lora=max_lora,
        running_lora=_names(running_lora),
        waiting_lora=_names(waiting_lora),
        now=time.time() if now is None else now,
    ).encode()


def _names(adapters: set[str]) -> str:
    if not adapters:
        return ""
    joined = ",".join(sorted(adapters))
    return joined.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
