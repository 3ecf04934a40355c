"""Every benchmark command that RESULTS.md, the benchmarks README or the Makefile names still exists
with the flags it is written with: each `python -m benchmarks.X ... --flag` is checked against the
options `python -m benchmarks.X --help` lists (so a table stays reproducible by the command beside it)."""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "benchmarks" / "RESULTS.md", ROOT / "benchmarks" / "README.md", ROOT / "Makefile",
        ROOT / "docs" / "operations.md"]
COMMAND = re.compile(r"-m\s+benchmarks\.([a-z_]+)((?:[^`\n#]|\\\n)*)")


def commands() -> list[tuple[str, str, list[str]]]:
    """(where, module, the flags written after it), one per command in the docs."""
    found = []
    for doc in DOCS:
        text = re.sub(r"\\\n\s*", " ", doc.read_text())  # continuation lines joined
        text = re.sub(r"(benchmarks\.[a-z_]+[^`\n]*)\n(?=[^`\n]*`)", r"\1 ", text)  # a command wrapped inside `...`
        for match in COMMAND.finditer(text):
            module, rest = match.group(1), match.group(2)
            try:
                words = shlex.split(rest.replace("|", " "))
            except ValueError:
                words = rest.split()
            flags = []
            for word in words:
                if word == "--":  # what follows goes to `gateway serve` (benchmarks.targets)
                    break
                word = word.strip("[]()`',;")
                if word.startswith("--") and len(word) > 2:
                    flags.append(word.split("=")[0])
            line = text[: match.start()].count("\n") + 1
            found.append((f"{doc.name}:{line}", module, flags))
    return found


@cache
def options(module: str) -> frozenset[str]:
    done = subprocess.run([sys.executable, "-m", f"benchmarks.{module}", "--help"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, check=False)
    assert done.returncode == 0, f"benchmarks.{module} --help failed: {done.stderr[-2000:]}"
    return frozenset(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", done.stdout))


def test_the_docs_name_commands() -> None:
    modules = {module for _, module, _ in commands()}
    assert {"race", "growth", "targets", "loadgen", "app_cost", "echo_engine", "instant_endpoint"} <= modules


@pytest.mark.parametrize(("where", "module", "flags"), commands(), ids=lambda v: v if isinstance(v, str) else None)
def test_every_flag_is_accepted(where: str, module: str, flags: list[str]) -> None:
    assert (ROOT / "benchmarks" / module).with_suffix(".py").exists() or (ROOT / "benchmarks" / module).is_dir(), \
        f"{where}: benchmarks.{module} is gone"
    unknown = [f for f in flags if f not in options(module)]
    assert not unknown, f"{where}: benchmarks.{module} no longer takes {unknown}"
