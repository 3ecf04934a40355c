"""LoRA adapters as files: what a PEFT adapter directory holds (`adapter_config.json` and its weights), read without
vllm, the digest of those files (what answers under an adapter's name), and the `max_lora_rank` slot each needs.

A directory is named by a client (the admin API), so whatever the file system says of it (missing, not a directory,
a name too long, a loop of links, no permission, a NUL character) is an AdapterError naming the path, never an
OSError."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
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


# what the file system's refusals of a client's path mean, in its terms
_REFUSALS = {errno.ENOENT: "does not exist", errno.ENOTDIR: "does not exist", errno.ELOOP: "is a loop of symbolic links",
             errno.ENAMETOOLONG: "is a name too long for the file system", errno.EACCES: "cannot be read: permission denied",
             errno.EPERM: "cannot be read: permission denied", errno.EISDIR: "is a directory, not a file"}


def unreadable(path: Path, exc: OSError | ValueError) -> AdapterError:
    """The file system's refusal of `path` (an OSError, or the ValueError of a NUL character), naming it."""
    if isinstance(exc, ValueError):
        return AdapterError(f"{str(path)!r} is not a path: {exc}")
    why = _REFUSALS.get(exc.errno or 0) or f"cannot be read: {exc.strerror or exc}"
    return AdapterError(f"{path} {why}")


def folder_of(path: str | Path) -> Path:
    """`path` as the adapter directory it must be, or AdapterError naming why not."""
    folder = Path(path)
    try:
        mode = os.stat(folder).st_mode
    except (OSError, ValueError) as exc:
        raise AdapterError(f"the adapter directory {unreadable(folder, exc)}") from exc
    if not stat.S_ISDIR(mode):
        raise AdapterError(f"the adapter directory {folder} is not a directory")
    return folder


def _is_file(path: Path) -> bool:
    """A regular file (a link to one too): what reading cannot hang on."""
    try:
        return stat.S_ISREG(os.stat(path).st_mode)
    except FileNotFoundError:
        return False
    except OSError as exc:  # a path past the system's length, a loop of links
        raise unreadable(path, exc) from exc


def digest(path: str | Path) -> str:
    """A SHA-256 of the adapter's config and weights as they are on disk: the identity of what answers under its name
    (the response cache's key), the same in every process that loads the same files. It reads every weight, so it is
    called off the event loop."""
    folder, whole = folder_of(path), hashlib.sha256()
    for name in ("adapter_config.json", *WEIGHT_FILES):
        file = folder / name
        if not _is_file(file):  # missing (`read` says so), or what never ends (a pipe, /dev/zero)
            continue
        try:
            with file.open("rb") as opened:
                whole.update(name.encode() + b"\0" + hashlib.file_digest(opened, "sha256").digest())
        except OSError as exc:
            raise unreadable(file, exc) from exc
    return whole.hexdigest()


def read(path: str | Path) -> AdapterFiles:
    """The adapter in `path`, or AdapterError naming what is wrong."""
    folder = folder_of(path)
    config_file = folder / "adapter_config.json"
    if not _is_file(config_file):
        raise AdapterError(f"the adapter directory {folder} has no adapter_config.json file")
    try:
        config = json.loads(config_file.read_text())
    except OSError as exc:
        raise unreadable(config_file, exc) from exc
    except (ValueError, RecursionError) as exc:  # RecursionError: arrays nested past the parser's depth
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
    if not any(_is_file(folder / name) for name in WEIGHT_FILES):
        raise AdapterError(f"the adapter directory {folder} has no weights ({' or '.join(WEIGHT_FILES)})")
    weights = folder / WEIGHT_FILES[0]
    shapes = _shapes(weights, rank) if _is_file(weights) else {}
    modules = config.get("target_modules") or ()
    if not isinstance(modules, str | list):
        raise AdapterError(f"{config_file}: its target_modules is not a module name or a list of them")
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
        raise unreadable(weights, exc) from exc
    except (ValueError, RecursionError) as exc:
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
