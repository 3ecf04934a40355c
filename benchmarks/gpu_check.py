"""`make gpu-check`: on a machine with an NVIDIA GPU, the `gpu` extra installed into .venv-gpu, the
model prepared, the integration suite and the race run there, REPORT.md written under
benchmarks/results/gpu-check-<time>/. Without a GPU it prints what it would do and exits 0.
Standard library only: it runs before any venv exists."""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
VENV = ".venv-gpu"
# Several engines share the GPU in the integration suite (the session gateway, a second one with its
# models file, the versions one): a quarter of its memory each instead of vLLM's 0.9.
SUITE_ENV = {"GATEWAY_ENGINE__GPU_MEMORY_UTILIZATION": "0.25"}


@dataclass(frozen=True)
class Step:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)


@dataclass
class Outcome:
    step: Step
    status: int
    seconds: float


def _output(command: list[str], timeout: float) -> str | None:
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def detect_gpu() -> str | None:
    """A description of the NVIDIA GPUs here (`nvidia-smi -L`, else torch's view), or None."""
    smi = shutil.which("nvidia-smi")
    if smi is not None and "GPU" in (listed := _output([smi, "-L"], 30) or ""):
        return listed
    name = _output([sys.executable, "-c", "import torch; print(torch.cuda.get_device_name(0)) "
                    "if torch.cuda.is_available() else None"], 120)
    return name if name and name != "None" else None


def plan(python: str, results: Path) -> list[Step]:
    venv_python = str(ROOT / VENV / "bin" / "python")
    make = ["make", "--no-print-directory", "ENGINE=gpu", f"VENV={VENV}", f"PYTHON={python}"]
    return [
        Step("install", [*make, "install"]),
        Step("model", [*make, "model"]),
        Step("versions", [venv_python, "-m", "pip", "list", "--format=freeze"]),
        Step("integration", [venv_python, "-m", "pytest", "tests/integration", "-p", "no:cacheprovider", "-rfEs",
                             f"--junitxml={results / 'integration.xml'}"], SUITE_ENV),
        Step("race", [venv_python, "-m", "benchmarks.race", "--repeats", "1", "--dtype", "bfloat16",
                      "--results-dir", str(results / "race")]),
    ]


def describe(steps: list[Step], results: Path) -> str:
    lines = []
    for number, step in enumerate(steps, 1):
        env = " ".join(f"{k}={v}" for k, v in step.env.items())
        lines.append(f"  {number}. {step.name}: {env + ' ' if env else ''}{' '.join(step.command)}")
    lines.append(f"  {len(steps) + 1}. report: {results / 'REPORT.md'}")
    return "\n".join(lines)


def run(steps: list[Step], results: Path) -> list[Outcome]:
    outcomes = []
    for step in steps:
        started = time.monotonic()
        with open(results / f"{step.name}.log", "w") as log:
            print(f"gpu-check: {step.name} ...", flush=True)
            done = subprocess.run(step.command, cwd=ROOT, env={**os.environ, **step.env}, stdout=log,
                                  stderr=subprocess.STDOUT, check=False)
        outcomes.append(Outcome(step, done.returncode, time.monotonic() - started))
        if done.returncode != 0 and step.name in ("install", "model"):
            break  # nothing after them can run
    return outcomes


def suite_counts(junit: Path) -> str:
    if not junit.is_file():
        return "no result (the suite did not run)"
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    total = {key: sum(int(s.get(key, 0)) for s in suites) for key in ("tests", "failures", "errors", "skipped")}
    passed = total["tests"] - total["failures"] - total["errors"] - total["skipped"]
    return f"{passed} passed, {total['failures']} failed, {total['errors']} errors, {total['skipped']} skipped"


def report(gpu: str, outcomes: list[Outcome], results: Path) -> Path:
    versions_log = results / "versions.log"
    pinned = [line for line in (versions_log.read_text().splitlines() if versions_log.is_file() else [])
              if line.split("==")[0].lower() in ("vllm", "torch", "transformers", "llm-gateway")]
    rows = [f"| {o.step.name} | {'ok' if o.status == 0 else f'failed ({o.status})'} | {o.seconds:.0f} s | "
            f"{o.step.name}.log |" for o in outcomes]
    race_files = sorted(p.name for p in (results / "race").glob("*")) if (results / "race").is_dir() else []
    text = "\n".join([
        "# gpu-check", "",
        f"GPU: {gpu}", "",
        "Versions: " + (", ".join(pinned) or "unknown"), "",
        "| step | status | time | log |", "|---|---|---|---|", *rows, "",
        f"Integration suite: {suite_counts(results / 'integration.xml')}", "",
        "Race: " + (", ".join(race_files) or "no result"), "",
    ])
    path = results / "REPORT.md"
    path.write_text(text)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.gpu_check", description=__doc__.split("\n")[0])
    parser.add_argument("--dry-run", action="store_true", help="print what would run, even on a GPU machine")
    parser.add_argument("--results-dir", type=Path, default=None)
    args = parser.parse_args(argv)
    results = args.results_dir or ROOT / "benchmarks" / "results" / f"gpu-check-{time.strftime('%Y%m%d-%H%M%S')}"
    steps = plan(sys.executable, results)
    gpu = detect_gpu()
    if gpu is None or args.dry_run:
        why = f"GPU found ({gpu}), dry run" if gpu else "No NVIDIA GPU here (no working nvidia-smi, torch sees no CUDA device)"
        print(f"gpu-check: {why}: nothing installed or run. On a GPU machine this would run, from {ROOT}:")
        print(describe(steps, results))
        return 0
    results.mkdir(parents=True, exist_ok=True)
    print(f"gpu-check on {gpu}; results in {results}")
    outcomes = run(steps, results)
    print(f"gpu-check: report at {report(gpu, outcomes, results)}")
    return 0 if len(outcomes) == len(steps) and all(o.status == 0 for o in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
