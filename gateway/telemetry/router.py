"""The router's page (`GET /metrics/router`): the pod's load as an endpoint picker reads it, and
nothing else.

An endpoint picker (llm-d's router, the Gateway API Inference Extension's EPP) scrapes every pod
of its pool every 50 to 100 ms and reads five of vLLM's series; where a family has several series it
takes one of them (the first, or for LoRA the newest), so a pod serving two models on /metrics
would be judged by one model's numbers. Here each family has exactly one series, the pod's:

- `vllm:num_requests_waiting`: the engines' queues plus the requests waiting in the gateway's
  admission queues, of all models (a request the gateway holds back is queued as surely as one
  vLLM holds back);
- `vllm:num_requests_running`: the engines' running batches, added up;
- `vllm:kv_cache_usage_perc`: the fullest embedded engine's KV cache (the max, not the mean: the
  picker cannot tell which model a pod's full engine serves, and a mean would hide it);
- `vllm:cache_config_info{block_size, num_gpu_blocks}`: the smallest block size of the engines
  and their blocks added up (the prefix-cache scorer sizes its per-pod index with them);
- `vllm:lora_requests_info{running_lora_adapters, waiting_lora_adapters, max_lora}`: the engines'
  adapters (union) and slots (sum), valued with the time as vLLM's is.

It is formatted by hand from the engines' `EngineLoad` (kept current by the engines as they step)
and the admission queues' counters: no registry collect. Measured (2026-12, this machine's CPU):
3.5 us a page; 44 us of CPU a request through the whole app (`python -m benchmarks.app_cost
--scenario router-page`), against 235 us for /metrics on the echo engine (more with vLLM's series).
"""

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
    """The exposition for the embedded engines' `loads` and the requests waiting for admission."""
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
    """A label value: the adapters' names, comma-separated, escaped as the text format wants."""
    if not adapters:
        return ""
    joined = ",".join(sorted(adapters))
    return joined.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")
