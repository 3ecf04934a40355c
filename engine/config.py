"""Engine settings: what the gateway's one Settings object holds for the embedded engine.

A plain pydantic model (no vllm import); `engine.vllm_engine` turns it into vLLM's engine args.
The GPU path is configuration only: install the `gpu` extra and set, say,
`GATEWAY_ENGINE__GPU_MEMORY_UTILIZATION=0.9`, `GATEWAY_ENGINE__TENSOR_PARALLEL_SIZE=2`.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field


class EngineSettings(BaseModel):
    model: str | None = Field(
        None, description="Model directory or hub id; unset: the prepared default model"
    )
    served_model_name: str = Field(
        "smollm2-135m-instruct", description="The name clients send as `model`"
    )
    task: Literal["generate", "embed"] = Field(
        "generate", description="generate: text (chat, completions); embed: vectors, with vLLM's pooling runner"
    )
    max_model_len: int | None = Field(2048, description="Context length (prompt + output)")
    dtype: str = Field("auto", description="Weights and activations dtype (auto, bfloat16, ...)")
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of accelerator memory (on the CPU: of the NUMA node's memory) "
        "for weights and KV cache; unset: 0.9 on a GPU, a 2 GiB KV cache on the CPU",
    )
    kv_cache_memory_bytes: int | None = Field(
        None, description="KV cache size in bytes, instead of the fraction (CPU default: 2 GiB; 512 MiB to embed)"
    )
    enforce_eager: bool = Field(False, description="Skip torch.compile/CUDA graphs: faster start, slower decoding")
    enable_prefix_caching: bool | None = Field(None, description="Reuse KV blocks of shared prefixes (vLLM default: on)")
    tensor_parallel_size: int = Field(1, ge=1)
    pipeline_parallel_size: int = Field(1, ge=1)
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    max_num_seqs: int | None = Field(None, description="Most sequences batched at once")
    seed: int = 0
    trust_remote_code: bool = False
    log_format: Literal["text", "json"] | None = Field(
        None, description="vLLM's own log lines (all its processes): text or JSON; unset: as GATEWAY_LOG_FORMAT"
    )
    log_level: Literal["debug", "info", "warning", "error"] | None = Field(
        None, description="vLLM's own log level; unset: as GATEWAY_LOG_LEVEL"
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other vLLM engine argument by name, e.g. {\"kv_offloading_size\": 4}",
    )
