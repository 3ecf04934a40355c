"""LoRA adapters made for tests: a PEFT adapter directory (adapter_config.json and
adapter_model.safetensors) written with torch and safetensors, no `peft` needed.

A LoRA adapter adds `B @ A * (alpha / r)` to each target module's weight: `lora_A` is (r, in),
`lora_B` is (out, r). The weights here are drawn from a seeded generator (deterministic, non-zero:
PEFT's own initialisation makes B zero, an adapter that changes nothing), scaled so that the
model's greedy answers change but stay words.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# SmolLM2-135M: 30 layers, hidden 576, 9 query heads and 3 key/value heads of 64
SMOLLM2 = {"layers": 30, "q_proj": (576, 576), "v_proj": (576, 192)}


def write_adapter(folder: Path, seed: int, rank: int = 8, alpha: int = 16, scale: float = 0.05,
                  base: str = "smollm2-135m-instruct", shape: dict[str, Any] = SMOLLM2) -> Path:
    """A rank-`rank` LoRA adapter of `base`'s q_proj and v_proj in `folder` (made if missing)."""
    import torch
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(shape["layers"]):
        for module in ("q_proj", "v_proj"):
            fan_in, fan_out = shape[module]
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=generator) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=generator) * scale
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base,
        "r": rank, "lora_alpha": alpha, "lora_dropout": 0.0, "target_modules": ["q_proj", "v_proj"],
        "bias": "none", "fan_in_fan_out": False, "modules_to_save": None, "use_rslora": False,
        "use_dora": False, "inference_mode": True,
    }
    (folder / "adapter_config.json").write_text(json.dumps(config, indent=2))
    return folder


def write_stub(folder: Path, rank: int = 8, hidden: int = 4) -> Path:
    """An adapter directory as the fake engine reads it (a config, and a safetensors file whose
    header names rank-`rank` q_proj weights of a `hidden`-wide model; its data, zeros, is never
    read): for the unit tests, without torch."""
    folder.mkdir(parents=True, exist_ok=True)
    config = {"peft_type": "LORA", "r": rank, "lora_alpha": 16, "target_modules": ["q_proj"]}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    prefix = "base_model.model.model.layers.0.self_attn.q_proj"
    size = rank * hidden * 4
    header = {f"{prefix}.lora_A.weight": {"dtype": "F32", "shape": [rank, hidden], "data_offsets": [0, size]},
              f"{prefix}.lora_B.weight": {"dtype": "F32", "shape": [hidden, rank], "data_offsets": [size, 2 * size]}}
    encoded = json.dumps(header).encode()
    (folder / "adapter_model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded + bytes(2 * size))
    return folder
