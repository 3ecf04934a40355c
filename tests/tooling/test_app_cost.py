"""benchmarks.app_cost: the app called in process answers every request (a non-200 stops the run),
and what it prints is a rate and a CPU cost, for the gateway (with parts off too) and the bare app."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).parents[2]
LINE = re.compile(r"^(?P<what>.+), (?P<scenario>[a-z-]+), concurrency (?P<c>\d+): (?P<rate>[\d.]+) req/s, (?P<cpu>[\d.]+) us CPU per request$")


def run(*args: str) -> re.Match[str]:
    result = subprocess.run([sys.executable, "-m", "benchmarks.app_cost", "--requests", "50", *args],
                            capture_output=True, text=True, cwd=ROOT, timeout=180)
    assert result.returncode == 0, result.stderr[-2000:]
    found = LINE.match(result.stdout.strip().splitlines()[-1])
    assert found, result.stdout
    assert float(found["rate"]) > 0
    assert float(found["cpu"]) > 0
    return found


@pytest.mark.parametrize("scenario", ["non-stream", "stream", "cache-hit"])
def test_the_gateway_answers_every_scenario(scenario: str) -> None:
    assert run("--scenario", scenario, "--concurrency", "4")["what"] == "gateway"


def test_parts_switched_off_and_the_bare_app() -> None:
    assert run("--without", "log", "metrics", "keys", "cache", "tokenizer")["what"].startswith("gateway without log")
    assert run("--bare")["what"] == "bare"
