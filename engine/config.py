"""Engine settings as a plain pydantic model (no vllm import), turned into vLLM's engine args by `engine.vllm_engine`.
Sampling defaults, strongest first: `sampling_defaults`, the model's `generation_config.json`, OpenAI's (vLLM's
order)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from engine.adapters import LORA_RANKS

# vLLM's names of the sampling parameters a generation config may set (HF's max_new_tokens is
# vLLM's max_tokens), as `vllm.config.ModelConfig.get_diff_sampling_param` reads them.
GENERATION_CONFIG_KEYS = (
    "temperature", "top_p", "top_k", "min_p", "repetition_penalty", "presence_penalty", "frequency_penalty",
)


class SamplingDefaults(BaseModel):
    """Per-model defaults of the sampling parameters; None: not set here (the next source decides)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float | None = Field(None, ge=0, description="Sampling temperature; 0: greedy")
    top_p: float | None = Field(
        None, gt=0, le=1, description="Nucleus sampling: draw from the likeliest tokens whose probabilities add up to this"
    )
    top_k: int | None = Field(None, ge=-1, description="Draw from the k likeliest tokens; -1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1, description="Tokens less likely than this times the likeliest are dropped")
    repetition_penalty: float | None = Field(None, gt=0, description="Above 1: tokens already in prompt or output less likely")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Penalty on tokens that appeared at all")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Penalty per appearance of a token")
    max_tokens: int | None = Field(None, ge=1, description="Chat output budget when a request sends none")

    def as_generation_config(self) -> dict[str, Any]:
        """In a generation config's terms (vLLM's `override_generation_config`)."""
        values = self.model_dump(exclude_none=True)
        if "max_tokens" in values:
            values["max_new_tokens"] = values.pop("max_tokens")
        return values

    @classmethod
    def from_generation_config(cls, diff: dict[str, Any]) -> SamplingDefaults:
        """From vLLM's `get_diff_sampling_param()` (keys already in vLLM's names); others ignored."""
        return cls.model_validate({k: v for k, v in diff.items() if k in (*GENERATION_CONFIG_KEYS, "max_tokens")})


class EngineSettings(BaseModel):
    """The embedded vLLM engine (per model in a models file's `engine:`); checked at start against the
    installed vLLM, the platform and the model's config.json."""

    model: str | None = Field(
        None, description="Model directory or hub id; unset: the prepared default model"
    )
    served_model_name: str = Field(
        "smollm2-135m-instruct", description="The name clients send as `model`"
    )
    task: Literal["generate", "embed"] = Field(
        "generate", description="generate: text (chat, completions); embed: vectors, with vLLM's pooling runner"
    )
    max_model_len: int | None = Field(
        2048, ge=1, description="Context length (prompt + output); unset: the model's own; refused at start above it"
    )
    dtype: str = Field(
        "auto",
        description="Weights and activations dtype (auto, bfloat16, float16, float32): auto is float32 on the CPU "
        "(bfloat16 is faster there but changes SmolLM2's answers), the model's own on a GPU",
    )
    gpu_memory_utilization: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Fraction of accelerator memory (on the CPU: of the NUMA node's memory) "
        "for weights and KV cache (on the CPU refused at start when less is free); unset: 0.9 on a GPU, "
        "a 2 GiB KV cache on the CPU",
    )
    kv_cache_memory_bytes: int | None = Field(
        None, description="KV cache size in bytes, instead of the fraction (CPU default: 2 GiB; 512 MiB to embed)"
    )
    enforce_eager: bool = Field(False, description="Skip torch.compile/CUDA graphs: faster start, slower decoding")
    enable_prefix_caching: bool | None = Field(None, description="Reuse KV blocks of shared prefixes (vLLM default: on)")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs one model is split across (tensor parallelism)")
    pipeline_parallel_size: int = Field(1, ge=1, description="Pipeline stages one model is split into")
    quantization: str | None = Field(
        None, description="vLLM quantization method (awq, gptq, fp8, compressed-tensors, ...); checked at start"
    )
    kv_cache_dtype: str = Field("auto", description="KV cache dtype: auto (the model's), fp8, fp8_e4m3, fp8_e5m2, ...")
    disable_sliding_window: bool = Field(
        False, description="Run a sliding-window model with full attention, its context capped at the window"
    )
    generation_config: str = Field(
        "auto",
        description="Where sampling defaults come from: auto (the model's generation_config.json), "
        "vllm (none: OpenAI's), or a directory holding a generation_config.json",
    )
    sampling_defaults: SamplingDefaults = Field(
        default_factory=SamplingDefaults, description="Sampling defaults over the generation config's"
    )
    prompt_special_tokens: Literal["tokens", "text"] = Field(
        "tokens",
        description="How /v1/completions reads a special token's spelling (`<|im_end|>`) in a text prompt: tokens "
        "(as vLLM: the raw prompt is the model's input) or text (its characters, as chat messages always are)",
    )
    max_num_seqs: int | None = Field(None, description="Most sequences batched at once; unset: vLLM's default")
    scheduling_policy: Literal["auto", "fcfs", "priority"] = Field(
        "auto",
        description="vLLM's scheduler: fcfs (arrival order) or priority (a request's priority, lower first: it is "
        "queued ahead and preempted last); auto: priority when the keys file gives a key a class other than "
        "normal or lets requests choose theirs (request_priority), else fcfs",
    )
    enable_lora: bool = Field(
        False,
        description="Serve LoRA adapters on this model (on by itself when the models file declares adapters of it; "
        "on the CPU it runs the engine eager)",
    )
    max_loras: int | None = Field(
        None, ge=1, description="LoRA: adapters one batch may hold; unset: the models file's adapters of this model (at most 8)"
    )
    max_lora_rank: int | None = Field(
        None,
        description="LoRA: the highest adapter rank (1, 8, 16, 32, 64, 128, 256, 320 or 512); unset: the models "
        "file's highest, else 16",
    )
    max_cpu_loras: int | None = Field(
        None, ge=1,
        description="LoRA: adapters kept loaded in host memory (beyond: the least recently used is read from disk "
        "again when asked for); unset: the models file's adapters of this model, at least max_loras",
    )
    seed: int = Field(0, description="The engine's random seed")
    trust_remote_code: bool = Field(False, description="Allow model code from the model directory or hub to run")
    log_format: Literal["text", "json"] | None = Field(
        None,
        description="vLLM's own log lines (all its processes: front end, engine core, worker): text or json (vLLM's "
        "JSON: asctime, levelname, name, processName, process, message); unset: as GATEWAY_LOG_FORMAT",
    )
    log_level: Literal["debug", "info", "warning", "error"] | None = Field(
        None, description="vLLM's own log level; unset: as GATEWAY_LOG_LEVEL"
    )
    otlp_traces_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP endpoint of vLLM's own traces (its llm_request span: queue, prefill, decode); "
        "unset: as tracing.otlp_endpoint when tracing.engine_spans is on, else none",
    )
    engine_args: dict[str, Any] = Field(
        default_factory=dict,
        description="Any other vLLM engine argument by name, e.g. {\"kv_offloading_size\": 4} for CPU KV "
        "offloading; unknown names are refused at start",
    )

    @field_validator("max_lora_rank")
    @classmethod
    def _a_rank_vllm_serves(cls, rank: int | None) -> int | None:
        if rank is not None and rank not in LORA_RANKS:
            raise ValueError(f"max_lora_rank must be one of {', '.join(map(str, LORA_RANKS))}, not {rank}")
        return rank
