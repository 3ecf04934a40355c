"""`make gpu-check` (benchmarks/gpu_check.py): without a GPU it says what it would do and changes
nothing; with one it finds it; its report reads the suite's counts and each step's status."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from benchmarks import gpu_check
from tests.tooling.k8s import ROOT


def fake_nvidia_smi(folder: Path, output: str, status: int = 0) -> dict[str, str]:
    script = folder / "nvidia-smi"
    script.write_text(f"#!/bin/sh\nprintf '%s\\n' '{output}'\nexit {status}\n")
    script.chmod(0o755)
    return {**os.environ, "PATH": f"{folder}:{os.environ['PATH']}"}


def test_without_a_gpu_it_prints_the_plan_and_exits_0(tmp_path: Path) -> None:
    env = {**os.environ, "PATH": f"{tmp_path}:/usr/bin:/bin"}  # no nvidia-smi
    result = subprocess.run(["make", "-s", "gpu-check", "ENGINE=gpu", f"PYTHON={sys.executable}",
                             f"ARGS=--results-dir {tmp_path / 'out'}"], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=300)
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


def test_it_finds_a_gpu_through_nvidia_smi(tmp_path: Path, monkeypatch) -> None:
    env = fake_nvidia_smi(tmp_path, "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)")
    monkeypatch.setenv("PATH", env["PATH"])
    assert gpu_check.detect_gpu() == "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-1234)"


def test_a_failing_nvidia_smi_is_no_gpu(tmp_path: Path, monkeypatch) -> None:
    env = fake_nvidia_smi(tmp_path, "NVIDIA-SMI has failed because it could not communicate with the driver", 9)
    monkeypatch.setenv("PATH", env["PATH"])
    assert gpu_check.detect_gpu() is None  # and this venv's torch is the CPU build


def test_report(tmp_path: Path) -> None:
    (tmp_path / "integration.xml").write_text(
        '<testsuites><testsuite tests="60" failures="1" errors="0" skipped="4"/></testsuites>')
    (tmp_path / "versions.log").write_text("vllm==0.32.0\ntorch==2.13.0\nhttpx==0.28.1\n")
    (tmp_path / "race").mkdir()
    (tmp_path / "race" / "race-1.md").write_text("")
    steps = {step.name: step for step in gpu_check.plan(sys.executable, tmp_path)}
    outcomes = [gpu_check.Outcome(steps["install"], 0, 100), gpu_check.Outcome(steps["integration"], 1, 300)]
    text = gpu_check.report("GPU 0: NVIDIA L4", outcomes, tmp_path).read_text()
    assert "GPU: GPU 0: NVIDIA L4" in text
    assert "vllm==0.32.0, torch==2.13.0" in text
    assert "| integration | failed (1) | 300 s |" in text
    assert "| install | ok | 100 s |" in text
    assert "55 passed, 1 failed, 0 errors, 4 skipped" in text
    assert "race-1.md" in text
