"""The error table in docs/api.md and the one in code (gateway/errors.py) are the same table."""

from __future__ import annotations

import re
from pathlib import Path

from gateway.errors import error_table

API_DOC = Path(__file__).parents[2] / "docs" / "api.md"


def documented_rows() -> set[tuple[int, str, str | None]]:
    text = API_DOC.read_text()
    section = text[text.index("## Errors"):]
    rows = set()
    for line in section.splitlines():
        match = re.match(r"\|\s*(\d{3})\s*\|\s*(\w+)\s*\|\s*`?([\w]+)`?\s*\|", line)
        if match:
            code = None if match.group(3) == "null" else match.group(3)
            rows.add((int(match.group(1)), match.group(2), code))
    return rows


def test_the_documented_error_table_matches_code() -> None:
    assert documented_rows() == set(error_table())
