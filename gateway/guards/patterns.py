"""Finding spans in text: a `Detector` per check (a deny pattern, an injection pattern, a kind of personal data), a
`Scanner` that runs a profile's detectors outside its allowed spans, and the `Placeholders` that redaction puts in the
text and restoration takes out again."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field

from gateway.guards.normalize import Normalized, normalize, pattern

Spans = Callable[[str], Iterator[tuple[int, int]]]


def regex_spans(pattern: re.Pattern[str]) -> Spans:
    def spans(text: str) -> Iterator[tuple[int, int]]:
        for match in pattern.finditer(text):
            if match.end() > match.start():
                yield match.start(), match.end()

    return spans


@dataclass(frozen=True, slots=True)
class Detector:
    guard: str  # its name in metrics and the access log: "deny", "injection", "pii.email", ...
    action: str  # flag, redact or block
    label: str  # the placeholder's word when it redacts: EMAIL, PHONE, ...
    spans: Spans = field(compare=False)
    detail: str | None = None  # e.g. which injection pattern: logged, never the text


@dataclass(frozen=True, slots=True)
class Match:
    detector: Detector
    start: int
    end: int

    @property
    def action(self) -> str:
        return self.detector.action


class Scanner:
    """A profile's detectors for one direction (input or output), and its exemptions."""

    def __init__(self, detectors: Iterable[Detector], allow: Iterable[str] = ()) -> None:
        self.detectors = [d for d in detectors if d.action != "off"]
        self.allow = [re.compile(pattern(p)) for p in allow]

    def __bool__(self) -> bool:
        return bool(self.detectors)

    def scan(self, text: str) -> list[Match]:
        """Every match outside the allowed spans, by position in `text`; the detectors read it
        normalized (`guards.normalize`), the matches are its own spans."""
        return self.scan_normalized(normalize(text))

    def scan_normalized(self, normalized: Normalized) -> list[Match]:
        text = normalized.text
        allowed = [(m.start(), m.end()) for p in self.allow for m in p.finditer(text)]
        found = [
            Match(d, *normalized.span(start, end))
            for d in self.detectors
            for start, end in d.spans(text)
            if not any(a <= start and end <= b for a, b in allowed)
        ]
        return sorted(found, key=lambda m: (m.start, -m.end))


def first_block(matches: Iterable[Match], after: int = 0) -> Match | None:
    """The first blocking match that ends past `after` (text before it was already passed)."""
    return next((m for m in matches if m.action == "block" and m.end > after), None)


def disjoint(matches: Iterable[Match], action: str) -> list[Match]:
    """The matches of one action that do not overlap an earlier (or longer) one."""
    kept: list[Match] = []
    for match in matches:
        if match.action == action and (not kept or match.start >= kept[-1].end):
            kept.append(match)
    return kept


class Placeholders:
    """Redacted values and their placeholders (`[EMAIL_1]`): one per distinct value in a request,
    so that the answer can name them and get the values back."""

    PLACEHOLDER = re.compile(r"\[([A-Z][A-Z0-9_]*?)_(\d+)\]")

    def __init__(self) -> None:
        self._by_value: dict[tuple[str, str], str] = {}
        self._values: dict[str, str] = {}
        self._longest = 0  # the longest placeholder given: how far back an unfinished one may begin

    def __bool__(self) -> bool:
        return bool(self._values)

    def name(self, label: str, value: str) -> str:
        key = (label, value)
        if key not in self._by_value:
            count = sum(1 for lab, _ in self._by_value if lab == label) + 1
            self._by_value[key] = f"[{label}_{count}]"
            self._values[self._by_value[key]] = value
            self._longest = max(self._longest, len(self._by_value[key]))
        return self._by_value[key]

    def restore(self, text: str, quoted: bool = False) -> str:
        """`text` with the placeholders given put back; `quoted`: the text is JSON (a tool call's
        arguments, structured output), where a placeholder stands in a string: the value goes in
        escaped as one (a quote, a backslash or a tab in it would break the JSON)."""
        if not self._values or "[" not in text:
            return text
        return self.PLACEHOLDER.sub(lambda m: self._value(m.group(0), quoted), text)

    def _value(self, name: str, quoted: bool) -> str:
        """The value a placeholder stands for (the placeholder if none), escaped only when it is put back."""
        value = self._values.get(name)
        if value is None:
            return name
        return json.dumps(value, ensure_ascii=False)[1:-1] if quoted else value

    def unfinished(self, text: str) -> int:
        """Where one of the placeholders given may begin at the end of `text`, unfinished (len(text)
        if none may): held back there, a placeholder split over any number of a stream's pieces,
        however long its name, is restored whole."""
        start = text.rfind("[", max(0, len(text) - self._longest))
        if start < 0:
            return len(text)
        begun = text[start:]
        return start if any(name.startswith(begun) and name != begun for name in self._values) else len(text)


def redact(text: str, matches: Iterable[Match], replace: Callable[[Match, str], str]) -> str:
    """`text` with each of `matches` (disjoint, in order) replaced."""
    parts, at = [], 0
    for match in matches:
        parts += [text[at : match.start], replace(match, text[match.start : match.end])]
        at = match.end
    parts.append(text[at:])
    return "".join(parts)
