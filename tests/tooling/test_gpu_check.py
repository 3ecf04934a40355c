"""`make gpu-check` (a Makefile recipe): without a GPU it says what it would do and changes nothing;
it finds a GPU through nvidia-smi; a run writes each step's status to REPORT.md, stops after a
failed install and fails when a step failed (its steps replaced here by stand-ins)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.tooling.k8s import ROOT


def make(folder: Path, *args: str, smi: str | None = None, status: int = 0) -> subprocess.CompletedProcess[str]:
    """`make gpu-check`, with a fake nvidia-smi printing `smi` (none: no nvidia-smi at all)."""
    if smi is not None:
        script = folder / "nvidia-smi"
        script.write_text(f"#!/bin/sh\nprintf '%s\\n' '{smi}'\nexit {status}\n")
        script.chmod(0o755)
    env = {**os.environ, "PATH": f"{folder}:/usr/bin:/bin"}
    return subprocess.run(["make", "-s", "gpu-check", "ENGINE=gpu", f"PYTHON={sys.executable}",
                           f"GPU_OUT={folder / 'out'}", *args], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=300, check=False)


def test_without_a_gpu_it_prints_the_plan_and_exits_0(tmp_path: Path) -> None:
    result = make(tmp_path)
    assert result.returncode == 0, result.stderr
    said = result.stdout
    assert "No NVIDIA GPU here" in said
    assert "nothing installed or run" in said
    assert "ENGINE=gpu VENV=.venv-gpu" in said
    assert " install" in said
    assert "-m pytest tests/integration" in said
    assert "-m benchmarks.race" in said
    assert str(tmp_path / "out" / "REPORT.md") in said
    assert not (tmp_path / "out").exists()


def test_it_finds_a_gpu_through_nvidia_smi(tmp_path: Path) -> None:
    result = make(tmp_path, "DRY_RUN=1", smi="GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)")
    assert result.stdout.startswith("gpu-check: GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234): nothing installed")
    assert not (tmp_path / "out").exists()


def test_a_failing_nvidia_smi_is_no_gpu(tmp_path: Path) -> None:
    # torch stood in for by one that sees no CUDA device: the real import is seconds, and tested above
    result = make(tmp_path, "GPU_TORCH=true", smi="NVIDIA-SMI has failed because it could not communicate with the driver",
                  status=9)
    assert "No NVIDIA GPU here" in result.stdout
    assert not (tmp_path / "out").exists()


def test_the_report_of_a_run(tmp_path: Path) -> None:
    steps = ('"install|echo installed" "versions|printf \'vllm==0.32.0\\ntorch==2.13.0\\nhttpx==0.28.1\\n\'" '
             '"integration|echo 55 passed, 1 failed in 300s; exit 1" "race|echo raced"')
    result = make(tmp_path, f"GPU_STEPS={steps}", smi="GPU 0: NVIDIA L4")
    assert result.returncode != 0, result.stdout + result.stderr  # make says the recipe failed
    text = (tmp_path / "out" / "REPORT.md").read_text()
    assert "GPU: GPU 0: NVIDIA L4" in text
    assert "| install | ok |" in text
    assert "| integration | failed (1) |" in text
    assert "| 55 passed, 1 failed in 300s |" in text
    assert "| race | ok |" in text  # a failed step does not stop the ones after it
    assert "Versions: vllm==0.32.0 torch==2.13.0" in text

    again = make(tmp_path, 'GPU_STEPS="install|exit 2" "race|echo raced"', smi="GPU 0: NVIDIA L4")
    assert again.returncode != 0
    text = (tmp_path / "out" / "REPORT.md").read_text()
    assert "| install | failed (2) |" in text
    assert "race" not in text  # nothing after a failed install can run
