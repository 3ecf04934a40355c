"""Output guards, streaming-aware: each field of each choice (its text, and what a backend fills
itself: reasoning, tool-call arguments) passes a sliding window as the backend produces it, so that
a match spanning chunks is caught.

Per field, text is held back until `holdback_chars` follow it (a match that may still grow is not
passed half-done), and `window_chars` of what was already passed stay in view, so a pattern that
straddles the two is still seen. A blocking match cuts the choice: what came before it is passed,
the rest is dropped, and it finishes with `content_filter`, as OpenAI's content filter does; once
every choice is done the generation ends (`Run` aborts it). Redactions are replaced as text is
passed; placeholders of the prompt's redactions are restored last, after the checks (which see the
model's text, not the user's values). With output moderation, text is passed in batches of
`moderation_chars`, each checked with everything before it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Protocol

from engine.types import ChoiceDelta, GenerationOutput, TokenLogprob, ToolCallDelta
from gateway.guards.config import OutputChecks
from gateway.guards.logprobs import LogprobFilter
from gateway.guards.normalize import Normalized, normalize
from gateway.guards.patterns import Match, Placeholders, Scanner, disjoint, first_block, redact

CONTENT_FILTER = "content_filter"
ALTERNATIVE_CONTEXT = 64  # the text before a logprob's alternatives that they are read after (one scan each)


class Notes(Protocol):
    """What the output guard tells its request guard (`pipeline.RequestGuard`)."""

    def note_match(self, stage: str, match: Match, text: str) -> None: ...

    async def moderate(self, stage: str, text: str, action: str) -> str | None: ...


def _output_placeholder(match: Match, value: str) -> str:
    return f"[{match.detector.label}]"  # the model's own personal data: nothing to restore


class ChoiceFilter:
    """One choice's sliding window: `feed` text as it comes, get back what may be passed on."""

    def __init__(self, scanner: Scanner, checks: OutputChecks, restore: Placeholders | None,
                 note: Callable[[Match, str], None], batch: int = 0) -> None:
        self.scanner, self.restore, self.note = scanner, restore, note
        self.holdback, self.window, self.batch = checks.holdback_chars, checks.window_chars, batch
        self.pending = ""  # the model's text not passed on yet
        self.tail = ""  # the end of what was passed on (as the model wrote it), still in view
        self.at = 0  # how much of the model's text was passed on (where `pending` begins in it)
        self.before = 0  # `at` before the last feed
        self.logprobs = LogprobFilter(scanner, min(self.window, ALTERNATIVE_CONTEXT))
        self.done = False
        self.cut = False

    def feed(self, text: str, final: bool) -> str:
        """What of the text so far may go on now (redacted, placeholders not yet restored); sets
        `cut` when a guard blocked."""
        if self.done:
            return ""
        self.before = self.at
        self.pending += text
        view, offset = self.tail + self.pending, len(self.tail)
        normalized = normalize(view)
        matches = self.scanner.scan_normalized(normalized) if self.scanner else []
        blocking = first_block(matches, after=offset)
        if blocking is not None:
            self.note(blocking, view)
            self.done = self.cut = True
            return self._pass(view, offset, max(offset, blocking.start), matches)
        safe = len(view) if final else self._safe(normalized, offset, matches)
        self.done = final
        return self._pass(view, offset, safe, matches)

    def _safe(self, normalized: Normalized, offset: int, matches: list[Match]) -> int:
        """How far the text may be passed: not into the held-back end (counted in the text as the
        guards read it, so that invisible characters padding a word do not push its beginning
        out), nor into a match that runs past that point (it may still grow), nor into a
        placeholder still being written."""
        view = normalized.original
        safe = normalized.position(max(0, len(normalized.text) - self.holdback))
        for match in matches:
            if match.end > offset and match.start < safe < match.end:
                safe = max(offset, match.start)
        if self.restore is not None:
            safe = min(safe, self.restore.unfinished(view[:safe]))
        if safe - offset < self.batch:
            return offset  # output moderation checks text in batches
        return max(offset, safe)

    def _pass(self, view: str, offset: int, upto: int, matches: list[Match]) -> str:
        passed = view[offset:upto]
        # what ends in the text passed now; a match that began in text already passed (a holdback
        # shorter than the match) is redacted from where that text ends
        inside = [m for m in matches if offset < m.end <= upto and m.action != "block"]
        for match in inside:
            if match.action == "flag":
                self.note(match, view)
        clipped = [Match(m.detector, max(m.start, offset) - offset, m.end - offset) for m in inside]
        redacted = disjoint(clipped, "redact")
        for match in redacted:
            self.note(match, passed)
            self.logprobs.redacted(self.at + match.start, self.at + match.end, _output_placeholder(match, ""))
        self.at += len(passed)
        self.pending = view[upto:]
        self.tail = (self.tail + passed)[-self.window :] if self.window else ""
        if self.cut:
            self.pending = ""
        return redact(passed, redacted, _output_placeholder)

    def retract(self) -> None:
        """The text of the last feed is not passed on after all (output moderation cut it)."""
        self.at = self.before
        self.done = self.cut = True

    def passed_logprobs(self, entries: tuple[TokenLogprob, ...] | None) -> tuple[TokenLogprob, ...] | None:
        """The logprobs that may go out with the text passed on so far (`entries`: the delta's)."""
        if entries is None:
            return None
        self.logprobs.add(entries)
        shown = self.logprobs.release(self.at, everything=self.done and not self.cut)
        if self.cut:
            self.logprobs.drop()
        return shown


class OutputGuard:
    """The output guard of one generation (n choices): rewrites each output's deltas. Its filters
    are slots: one per choice for its text (and the logprobs that spell it), and one per other field
    a backend fills itself (reasoning, each tool call's arguments), added as they come. A blocking
    match in any slot cuts the choice."""

    def __init__(self, notes: Notes, scanner: Scanner, checks: OutputChecks, restore: Placeholders | None,
                 n: int, apart: bool = False, json: bool = False, tag: str | None = None) -> None:
        self.notes = notes
        self.scanner, self.checks = scanner, checks
        self.restore = restore
        self.moderation = checks.moderation
        self.batch = checks.moderation_chars if self.moderation != "off" else 0
        self.filters: list[ChoiceFilter] = []
        self.passed: list[str] = []  # what each slot passed on so far, for moderation
        self.fields: dict[tuple[int, str | int], int] = {}  # (choice, "reasoning", "logprobs" or a call's index) → slot
        self.names: dict[tuple[int, int], tuple[str | None, str]] = {}  # (choice, call's index) → its id, its name so far
        # logprobs in a slot of their own, of the text they spell: a backend's whose logprobs may
        # spell another field than the choice's text (a remote upstream's tool call)
        self.apart = apart
        # the slots whose text is JSON, where placeholders are restored as JSON strings' contents:
        # every tool call's arguments, and the choices' text when the output is constrained to JSON
        self.quoted: set[int] = set(range(n)) if json else set()
        # the tag after which a choice's text is tool calls (JSON) parsed from it (`tools.TAG`), and
        # the end of each choice's text passed so far, until the tag is in it (then it is quoted)
        self.tag = tag
        self.before_tag: dict[int, str] = dict.fromkeys(range(n), "") if tag and not json else {}
        for _ in range(n):
            self._add_slot()

    def seen(self, text: str) -> None:
        """Choice 0's text passed on before this generation (a stream taken over on another replica,
        `serving.continuation.Prior`), in view of its checks as a failover's first part is in the one
        guard of its generation: a match that spans the seam is caught, moderation reads the whole."""
        chosen = self.filters[0]
        chosen.tail = text[-chosen.window :] if chosen.window else ""
        self.passed[0] = text

    def _add_slot(self) -> int:
        self.filters.append(ChoiceFilter(self.scanner, self.checks, self.restore, self._note, self.batch))
        self.passed.append("")
        return len(self.filters) - 1

    def _note(self, match: Match, text: str) -> None:
        self.notes.note_match("output", match, text)

    @property
    def stopped(self) -> bool:
        """A choice was cut and every other one is done: nothing more the engine makes can be
        passed on, so its request may end now."""
        return all(f.done for f in self.filters) and any(f.cut for f in self.filters)

    async def apply(self, output: GenerationOutput) -> GenerationOutput:
        return replace(output, choices=[await self._delta(delta) for delta in output.choices])

    async def _delta(self, delta: ChoiceDelta) -> ChoiceDelta:
        choice = self.filters[delta.index]
        if choice.done:  # cut earlier: the backend's tokens still count, nothing more is shown
            return replace(delta, text="", finish_reason=None, logprobs=None, reasoning="", tool_calls=())
        final = delta.finish_reason is not None
        if delta.reasoning or delta.tool_calls or (final and self.fields) or (self.apart and delta.logprobs):
            delta = await self._fields(delta, final)
            if choice.cut:
                return delta
        text = await self.feed(delta.index, delta.text, final)
        if choice.cut:
            self._cut(delta.index)
        finish = CONTENT_FILTER if choice.cut else delta.finish_reason
        logprobs = delta.logprobs if self.apart else choice.passed_logprobs(delta.logprobs)
        return replace(delta, text=text, finish_reason=finish, logprobs=logprobs)

    async def _fields(self, delta: ChoiceDelta, final: bool) -> ChoiceDelta:
        """A delta's reasoning and tool-call arguments, each through a slot of its own (on the
        choice's last delta, what each slot still holds goes out with it)."""
        index = delta.index
        names = await self._names(delta, final)
        if any(name is None for _, name in names.values()):
            self._cut(index)
            return replace(delta, text="", finish_reason=CONTENT_FILTER, logprobs=None, reasoning="", tool_calls=())
        pieces = self._pieces(delta, final)
        passed: dict[str | int, str] = {}
        for key, text in pieces.items():
            slot = self.fields.get((index, key))
            if slot is None:
                slot = self.fields[(index, key)] = self._add_slot()
                if isinstance(key, int):
                    self.quoted.add(slot)
            passed[key] = await self.feed(slot, text, final)
            if self.filters[slot].cut:
                self._cut(index)
                return replace(delta, text="", finish_reason=CONTENT_FILTER, logprobs=None, reasoning="", tool_calls=())
        calls = []
        for call in delta.tool_calls:
            held = (index, call.index) in self.names  # its name, and its id, go out once the name is whole
            call_id, name = names.pop(call.index, (None if held else call.id, None))
            calls.append(replace(call, arguments=passed.pop(call.index, ""), name=name, id=call_id))
        reasoning = str(passed.pop("reasoning", ""))
        logprobs, spelled = delta.logprobs, self.fields.get((index, "logprobs"))
        if passed.pop("logprobs", None) is not None and spelled is not None:
            logprobs = self.filters[spelled].passed_logprobs(delta.logprobs or ())
        calls += [ToolCallDelta(call, str(passed.pop(call, "")), name, call_id) for call, (call_id, name) in names.items()]
        calls += [ToolCallDelta(int(key), text) for key, text in passed.items() if text]
        calls = [call for call in calls if call.arguments or call.name]  # a piece whose name is held, and no more
        return replace(delta, reasoning=reasoning, tool_calls=tuple(calls), logprobs=logprobs)

    def _pieces(self, delta: ChoiceDelta, final: bool) -> dict[str | int, str]:
        """The delta's text per field slot: each call's arguments, reasoning, the logprobs' tokens."""
        pieces: dict[str | int, str] = {}
        for call in delta.tool_calls:  # a backend may send two pieces of one call in one delta
            pieces[call.index] = pieces.get(call.index, "") + call.arguments
        if delta.reasoning:
            pieces["reasoning"] = delta.reasoning
        if self.apart and delta.logprobs:
            pieces["logprobs"] = "".join(entry.token for entry in delta.logprobs)
        if final:
            for choice, key in self.fields:
                if choice == delta.index:
                    pieces.setdefault(key, "")
        return pieces

    async def _names(self, delta: ChoiceDelta, final: bool) -> dict[int, tuple[str | None, str | None]]:
        """The ids and names of the delta's choice's calls that are whole now, each name checked
        whole (None: a guard blocks it). A name may come in pieces (a client joins them): it is held,
        with its call's id, until the call's arguments begin, a later call does, or the choice ends,
        so that no piece of it leaves unchecked, and the call's first piece still names it."""
        for call in delta.tool_calls:
            key = (delta.index, call.index)
            if call.name or key in self.names:
                call_id, name = self.names.get(key, (None, ""))
                self.names[key] = (call_id or call.id, name + (call.name or ""))
        begun = [call.index for call in delta.tool_calls if call.arguments]
        whole = [key for key in self.names if key[0] == delta.index
                 and (final or any(key[1] <= other for other in begun) or any(key[1] < c.index for c in delta.tool_calls))]
        return {key[1]: (self.names[key][0], await self._name(self.names.pop(key)[1])) for key in whole}

    async def _name(self, name: str) -> str | None:
        """A tool call's name, checked whole (it comes in one piece): redacted, or None when a guard blocks it."""
        check = ChoiceFilter(self.scanner, self.checks, self.restore, self._note)
        shown = check.feed(name, final=True)
        if check.cut:
            return None
        return self.restore.restore(shown) if self.restore is not None else shown

    def _cut(self, index: int) -> None:
        """Choice `index` cut: every slot of it done, what they held back dropped."""
        slots = [index, *(slot for (choice, _), slot in self.fields.items() if choice == index)]
        for slot in slots:
            choice_filter = self.filters[slot]
            choice_filter.done = choice_filter.cut = True
            choice_filter.pending = ""
            choice_filter.logprobs.drop()

    async def feed(self, index: int, text: str, final: bool) -> str:
        """What of slot `index`'s text so far may go out now: checked, moderated (when its slot is),
        placeholders restored; the slot's filter says whether it was `cut`."""
        choice = self.filters[index]
        if choice.done:
            return ""
        text = choice.feed(text, final)
        if text and choice.batch and await self._moderate(index, text):
            choice.retract()
            text = ""
        if self.restore is None:
            return text
        if index in self.before_tag:
            return self._restored_around_tag(index, text)
        return self.restore.restore(text, index in self.quoted)

    def _restored_around_tag(self, index: int, text: str) -> str:
        """A choice's text whose calls the gateway parses from it: restored as prose up to the first
        tag, as JSON from it on (no placeholder spans the tag: its `<` cannot be in one)."""
        assert self.restore is not None
        assert self.tag is not None
        seen = self.before_tag[index]
        at = (seen + text).find(self.tag)
        if at < 0:
            self.before_tag[index] = (seen + text)[-len(self.tag) :]
            return self.restore.restore(text)
        del self.before_tag[index]
        self.quoted.add(index)
        cut = max(0, at - len(seen))
        return self.restore.restore(text[:cut]) + self.restore.restore(text[cut:], quoted=True)

    async def _moderate(self, index: int, text: str) -> bool:
        """True when the moderation upstream blocks the choice's text so far with `text` added
        (as the model wrote it: the user's redacted values are not sent there)."""
        verdict = await self.notes.moderate("output", self.passed[index] + text, self.moderation)
        if verdict == "block":
            return True
        self.passed[index] += text
        return False


def visible(output: GenerationOutput) -> GenerationOutput:
    """The output without the deltas that carry nothing to show (text held back)."""
    shown = [d for d in output.choices if d.text or d.finish_reason or d.logprobs or d.reasoning or d.tool_calls]
    return output if len(shown) == len(output.choices) else replace(output, choices=shown)
