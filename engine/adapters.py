"""LoRA adapters as files: what a PEFT adapter directory holds, read without vllm (the gateway checks
the models file's adapters at start with it; the engine checks a run-time load the same way).

A PEFT LoRA adapter is a directory with `adapter_config.json` (`peft_type: LORA`, its rank `r`,
`lora_alpha`, `target_modules`) and its weights, `adapter_model.safetensors` (or the older
`adapter_model.bin`). vLLM loads it into a base engine started with LoRA on, whose `max_lora_rank`
must be at least the adapter's rank and one of vLLM's sizes (`LORA_RANKS`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks, 0.32)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterError(ValueError):
    """An adapter directory that is missing or is not a LoRA adapter; the message says why."""


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    path: str
    rank: int
    target_modules: tuple[str, ...]
    base_model: str | None  # what the adapter says it was trained on (informative only)


def read(path: str | Path) -> AdapterFiles:
    """The adapter in `path`, or AdapterError naming what is wrong."""
    folder = Path(path)
    if not folder.is_dir():
        raise AdapterError(f"the adapter directory {folder} does not exist")
    config_file = folder / "adapter_config.json"
    try:
        config = json.loads(config_file.read_text())
    except OSError as exc:
        raise AdapterError(f"{config_file} cannot be read: {exc.strerror}") from exc
    except ValueError as exc:
        raise AdapterError(f"{config_file} is not valid JSON: {exc}") from exc
    if not isinstance(config, dict):
        raise AdapterError(f"{config_file} is not a JSON object")
    if str(config.get("peft_type", "")).upper() != "LORA":
        raise AdapterError(f"{config_file}: peft_type is {config.get('peft_type')!r}, not LORA")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise AdapterError(f"{config_file}: its rank `r` is {rank!r}, not a positive integer")
    if rank > LORA_RANKS[-1]:
        raise AdapterError(f"{config_file}: rank {rank} is above the largest vLLM serves ({LORA_RANKS[-1]})")
    if not any((folder / name).is_file() for name in WEIGHT_FILES):
        raise AdapterError(f"the adapter directory {folder} has no weights ({' or '.join(WEIGHT_FILES)})")
    modules = config.get("target_modules") or ()
    modules = (modules,) if isinstance(modules, str) else tuple(str(m) for m in modules)
    base = config.get("base_model_name_or_path")
    return AdapterFiles(str(folder), rank, modules, str(base) if base else None)


def rank_slot(rank: int) -> int:
    """The smallest vLLM `max_lora_rank` that holds an adapter of `rank`."""
    return next(slot for slot in LORA_RANKS if slot >= rank)
