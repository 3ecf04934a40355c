"""The logprobs of a choice's text, passed on with that text and no sooner: a token's text and the alternatives the
model weighed are each a way out for what the output guards keep in. A token goes out once its text was passed on
(`stream.ChoiceFilter`), never after a cut; inside a redacted span it shows the placeholder (on the span's first token)
and no alternatives; an alternative that would complete a blocking or redacting match is left out."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import replace

from engine.types import TokenLogprob
from gateway.guards.patterns import Scanner


class LogprobFilter:
    def __init__(self, scanner: Scanner, context_chars: int) -> None:
        self.scanner = scanner
        self.context_chars = context_chars
        self.waiting: deque[TokenLogprob] = deque()
        self.start = 0  # where the first waiting token begins in the choice's text
        self.context = ""  # the text before it (its end), as the tokens wrote it
        self.redactions: list[tuple[int, int, str]] = []  # (start, end, placeholder) in the choice's text

    def add(self, entries: Iterable[TokenLogprob]) -> None:
        self.waiting.extend(entries)

    def redacted(self, start: int, end: int, placeholder: str) -> None:
        self.redactions.append((start, end, placeholder))

    def release(self, upto: int, everything: bool = False) -> tuple[TokenLogprob, ...]:
        """The tokens whose text ends by `upto` (all of them with `everything`), as they may be shown."""
        shown = []
        while self.waiting:
            entry = self.waiting[0]
            end = self.start + len(entry.token)
            if end > upto and not everything:
                break
            self.waiting.popleft()
            shown.append(self._shown(entry, self.start, end))
            self.context = (self.context + entry.token)[-self.context_chars :] if self.context_chars else ""
            self.start = end
        self.redactions = [r for r in self.redactions if r[1] > self.start]
        return tuple(shown)

    def drop(self) -> None:
        """The rest was cut: its tokens are never shown."""
        self.waiting.clear()

    def _shown(self, entry: TokenLogprob, start: int, end: int) -> TokenLogprob:
        hidden = [r for r in self.redactions if r[0] < max(end, start + 1) and start < r[1]]
        if hidden:
            placeholder = next((p for s, _, p in hidden if s >= start), "")
            return replace(entry, token=placeholder, top=())
        if not entry.top:
            return entry
        top = tuple(alternative for alternative in entry.top if not self._completes_a_match(alternative[1]))
        return entry if len(top) == len(entry.top) else replace(entry, top=top)

    def _completes_a_match(self, token: str) -> bool:
        if not self.scanner:
            return False
        after = len(self.context)
        return any(m.action != "flag" and m.end > after for m in self.scanner.scan(self.context + token))
