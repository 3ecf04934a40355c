"""LoRA adapters as files: what a PEFT adapter directory holds (`adapter_config.json` and its weights), read without
vllm, and the `max_lora_rank` slot each needs."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# vLLM's allowed max_lora_rank values (vllm.config.lora.MaxLoRARanks, 0.32)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
WEIGHT_FILES = ("adapter_model.safetensors", "adapter_model.bin")


class AdapterError(ValueError):
    """An adapter directory that is missing or is not a LoRA adapter; the message says why."""


# modules whose input is the model's hidden state, and those whose output is (Llama-style names)
HIDDEN_IN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
HIDDEN_OUT = ("o_proj", "down_proj")
MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own bound on its JSON header


@dataclass(frozen=True, slots=True)
class AdapterFiles:
    path: str
    rank: int
    target_modules: tuple[str, ...]
    base_model: str | None  # what the adapter says it was trained on (informative only)
    # from the safetensors header: module name (q_proj, ...) → (input size, output size); empty for .bin
    shapes: dict[str, tuple[int, int]]

    def misfit(self, hidden_size: int) -> str | None:
        """Why the adapter does not fit a model of `hidden_size` (None: it fits, as far as seen here):
        vLLM loads such an adapter without a word and computes with part of it."""
        for module, (inputs, outputs) in sorted(self.shapes.items()):
            if module in HIDDEN_IN and inputs != hidden_size:
                return f"its {module} takes {inputs} inputs, the model's hidden size is {hidden_size}"
            if module in HIDDEN_OUT and outputs != hidden_size:
                return f"its {module} gives {outputs} outputs, the model's hidden size is {hidden_size}"
        return None


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
    weights = folder / WEIGHT_FILES[0]
    shapes = _shapes(weights, rank) if weights.is_file() else {}
    modules = config.get("target_modules") or ()
    modules = (modules,) if isinstance(modules, str) else tuple(str(m) for m in modules)
    base = config.get("base_model_name_or_path")
    return AdapterFiles(str(folder), rank, modules, str(base) if base else None, shapes)


def _header(weights: Path) -> dict[str, Any]:
    """The safetensors file's JSON header (8 bytes of its length, little-endian, then the JSON)."""
    try:
        with weights.open("rb") as file:
            size = int.from_bytes(file.read(8), "little")
            if not 0 < size <= MAX_HEADER_BYTES:
                raise AdapterError(f"{weights} is not a safetensors file")
            header = json.loads(file.read(size))
    except OSError as exc:
        raise AdapterError(f"{weights} cannot be read: {exc.strerror}") from exc
    except ValueError as exc:
        raise AdapterError(f"{weights} is not a safetensors file: {exc}") from exc
    if not isinstance(header, dict):
        raise AdapterError(f"{weights} is not a safetensors file")
    return header


def _shapes(weights: Path, rank: int) -> dict[str, tuple[int, int]]:
    """Each module's (input, output) size from its lora_A (rank x input) and lora_B (output x rank)
    weights, whose rank must be the config's."""
    shapes: dict[str, list[int]] = {}
    for name, entry in _header(weights).items():
        shape = entry.get("shape") if isinstance(entry, dict) else None
        for part, side in ((".lora_A.", 0), (".lora_B.", 1)):
            if part in name and isinstance(shape, list) and len(shape) == 2:
                if shape[side] != rank:
                    raise AdapterError(f"{weights}: {name} has rank {shape[side]}, its config says r={rank}")
                module = name.split(part)[0].rsplit(".", 1)[-1]
                shapes.setdefault(module, [0, 0])[side] = shape[1 - side]
    if not shapes:
        raise AdapterError(f"{weights} holds no LoRA weights (lora_A, lora_B)")
    return {module: (inputs, outputs) for module, (inputs, outputs) in shapes.items()}


def rank_slot(rank: int) -> int:
    """The smallest vLLM `max_lora_rank` that holds an adapter of `rank`."""
    return next(slot for slot in LORA_RANKS if slot >= rank)
