"""Prompt-injection patterns: the list shipped beside this module (`injection.yaml`), loaded once.

Which phrasings it holds, where they come from and how the list is kept: the file's header and the
docs/tenants-and-guards.md ("The prompt-injection list"). Each pattern is a detector of its own, so that the access log names which one matched.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import yaml

from gateway.guards.normalize import pattern
from gateway.guards.patterns import Detector, regex_spans

LIST = Path(__file__).with_name("injection.yaml")


@dataclass(frozen=True, slots=True)
class InjectionPattern:
    id: str
    category: str
    source: str
    regex: re.Pattern[str]
    examples: tuple[str, ...]


@cache
def patterns() -> tuple[InjectionPattern, ...]:
    entries = yaml.safe_load(LIST.read_text())["patterns"]
    return tuple(
        InjectionPattern(e["id"], e["category"], e["source"], re.compile(pattern(e["regex"]), re.IGNORECASE), tuple(e["examples"]))
        for e in entries
    )


def detectors(action: str) -> list[Detector]:
    return [Detector("injection", action, "INJECTION", regex_spans(p.regex), detail=p.id) for p in patterns()]
