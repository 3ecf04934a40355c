"""The guard pipeline: the compiled profiles (`Guards`, one per gateway), the choice of a request's
profile (`profile_for`: the API key's, else the model's, else the default), and a request's guard
(`RequestGuard`): input checks, the moderation call, and each generation's output guard. Every
action is counted (`gateway_guard_actions_total`) and named in the access line; the matched text
only when prompts are logged.
"""

from __future__ import annotations

import hashlib
import re
from bisect import bisect_right
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from engine.types import TokenLogprob
from gateway.errors import ContentPolicyViolation, ServiceUnavailable
from gateway.guards import config, injection, normalize, pii, secrets
from gateway.guards.config import Checks, GuardsFile, InputChecks, ModelGuards, Profile
from gateway.guards.logprobs import LogprobFilter
from gateway.guards.moderation import Moderation
from gateway.guards.patterns import Detector, Match, Placeholders, Scanner, disjoint, first_block, redact, regex_spans
from gateway.guards.stream import ALTERNATIVE_CONTEXT, OutputGuard
from gateway.telemetry import metrics
from gateway.telemetry.record import current_trace
from gateway.telemetry.tracing import stage


def scanner(checks: Checks) -> Scanner:
    """A direction's detectors: its deny patterns (a pattern named `project.name` redacts as
    [PROJECT_NAME_1]), the injection list, personal data."""
    rules = [Detector(r.name, r.action, re.sub(r"[^A-Z0-9]+", "_", r.name.upper()),
                      regex_spans(re.compile(normalize.pattern(r.pattern)))) for r in checks.rules()]
    found = [*rules, *injection.detectors(checks.injection), *pii.detectors(checks.pii)]
    if isinstance(checks, InputChecks):  # secrets: a prompt's (the client's own, not to be sent on)
        found += secrets.detectors(checks.secrets)
    return Scanner(found, checks.allow)


ACROSS_CHARS = 128  # a match split across a chat's texts is looked for this far on each side of the join


@dataclass(frozen=True, slots=True)
class CompiledProfile:
    name: str
    profile: Profile
    input: Scanner
    output: Scanner
    fingerprint: str  # part of the response cache's key: answers differ by profile

    @classmethod
    def of(cls, name: str, profile: Profile) -> CompiledProfile:
        digest = hashlib.sha256(profile.model_dump_json().encode()).hexdigest()[:16]
        return cls(name, profile, scanner(profile.input), scanner(profile.output), digest)


class Guards:
    """A gateway's guard profiles and the rule that picks one per request."""

    def __init__(self, file: GuardsFile, models: ModelGuards, moderation: Moderation | None = None) -> None:
        profiles, self.by_model = config.resolve(file, models)
        self.profiles = {name: CompiledProfile.of(name, p) for name, p in profiles.items()}
        self.default = file.default
        self.keys = dict(file.keys)
        self.key_profile: Callable[[str], str | None] | None = None  # the keys file's (gateway.tenancy.tenants)
        self.moderation = moderation or (Moderation(file.moderation) if file.moderation else None)

    @classmethod
    def load(cls, path: Path | None, models: ModelGuards) -> Guards:
        """From the guards file (none: no profiles but the models' inline ones); refused when bad."""
        return cls(config.read(path), models)

    def profile_for(self, key_id: str | None, *models: str) -> str | None:
        """The API key's profile if it has one (the keys file's, else the guards file's `keys:`), else
        the first of `models` (the name the client asked for, then the version that answers) that
        has one, else the default."""
        if key_id is not None and (named := self.key_profile and self.key_profile(key_id)):
            return named
        if key_id is not None and key_id in self.keys:
            return self.keys[key_id]
        for model in models:
            if model in self.by_model:
                return self.by_model[model]
        return self.default

    def for_request(self, key_id: str | None, *models: str, log_content: bool = False) -> RequestGuard:
        name = self.profile_for(key_id, *models)
        return RequestGuard(self.profiles[name], self.moderation, log_content) if name else UNGUARDED

    async def aclose(self) -> None:
        if self.moderation is not None:
            await self.moderation.aclose()


class RequestGuard:
    """One request's guard: its profile, the placeholders its redactions made, what it noted
    (`actions` as "stage:guard:action", and with `log_content` the matched text: the access line's)."""

    def __init__(self, profile: CompiledProfile | None, moderation: Moderation | None = None,
                 log_content: bool = False) -> None:
        self.profile = profile
        self.moderation = moderation
        self.log_content = log_content
        self.actions: list[str] = []
        self.matches: list[str] = []
        self.placeholders = Placeholders()
        self.prompt_text = ""
        self._noted: set[tuple[str, str, str, str]] = set()

    @property
    def active(self) -> bool:
        return self.profile is not None

    @property
    def reads_input(self) -> bool:
        """Whether the prompt's text is read on the way in (a check of it is configured)."""
        if self.profile is None:
            return False
        checks = self.profile.profile.input
        return bool(self.profile.input) or checks.max_chars is not None or checks.moderation != "off"

    @property
    def checks_output(self) -> bool:
        """Whether the answer's text is read on the way out (a check of it is configured)."""
        return self.profile is not None and (bool(self.profile.output) or self.profile.profile.output.moderation != "off")

    @property
    def cache_tag(self) -> str:
        return f"#guards:{self.profile.fingerprint}" if self.profile else ""

    def note(self, stage: str, guard: str, action: str, detail: str | None = None, text: str | None = None) -> None:
        """Count an action and name it in the access line (once per request, a fallback repeats them)."""
        key = (stage, guard, action, text or "")
        if key in self._noted:
            return
        self._noted.add(key)
        metrics.labelled(metrics.GUARD_ACTIONS, guard, stage, action).inc()
        self.actions.append(f"{stage}:{guard}{'/' + detail if detail else ''}:{action}")
        if self.log_content and text is not None:
            self.matches.append(f"{guard}: {text}")

    def note_match(self, stage: str, match: Match, text: str) -> None:
        secret = match.detector.guard.startswith("secrets.")  # a credential is not logged, even with prompts logged
        self.note(stage, match.detector.guard, match.action, match.detector.detail,
                  None if secret else text[match.start : match.end])

    # --- on the way in --------------------------------------------------------------------

    def check_input(self, texts: Sequence[str], param: str, together: bool = False) -> list[str]:
        """The prompt's texts as the engine may see them (redacted); refuses a prompt a guard
        blocks (ContentPolicyViolation, a 400 before any byte). Texts read `together` (one chat's
        messages, which the model reads as one prompt) are also read joined by a space, so that a
        match split across two of them is found."""
        if self.profile is None:
            return list(texts)
        checks = self.profile.profile.input
        size = sum(len(text) for text in texts)
        if checks.max_chars is not None and size > checks.max_chars:
            self.refuse("prompt_size", param, f"{size} characters; the limit is {checks.max_chars}")
        across = self._across(texts, param) if together and len(texts) > 1 else {}
        checked = [self._check_text(text, param, across.get(i, [])) for i, text in enumerate(texts)]
        self.prompt_text = "\n".join(checked)  # what moderation sees: redacted values stay redacted
        return checked

    def _blocked(self, match: Match, text: str, param: str) -> NoReturn:
        self.note_match("input", match, text)
        detail = f" ({match.detector.detail})" if match.detector.detail else ""
        raise ContentPolicyViolation(f"The prompt was refused by the content policy: guard {match.detector.guard}{detail}", param)

    def _check_text(self, text: str, param: str, pieces: list[tuple[Match, str]]) -> str:
        """One text checked; `pieces`: its parts of redacted matches that span texts, with what
        replaces each (the first part the placeholder, the others nothing)."""
        assert self.profile is not None
        matches = self.profile.input.scan(text)
        blocking = first_block(matches)
        if blocking is not None:
            self._blocked(blocking, text, param)
        for match in matches:
            if match.action == "flag":
                self.note_match("input", match, text)
        redacted = disjoint(matches, "redact")
        for match in redacted:
            self.note_match("input", match, text)
        if not pieces:
            return redact(text, redacted, lambda m, value: self.placeholders.name(m.detector.label, value))
        given = {id(match): replacement for match, replacement in pieces}
        kept = disjoint(sorted([*redacted, *(m for m, _ in pieces)], key=lambda m: (m.start, -m.end)), "redact")
        return redact(text, kept, lambda m, value: given[id(m)] if id(m) in given
                      else self.placeholders.name(m.detector.label, value))

    def _across(self, texts: Sequence[str], param: str) -> dict[int, list[tuple[Match, str]]]:
        """The matches that only the texts joined find (they span two or more), looked for within
        `ACROSS_CHARS` of each join: blocked, noted, or split into the pieces each text redacts."""
        assert self.profile is not None
        starts, at = [], 0
        for text in texts:
            starts.append(at)
            at += len(text) + 1
        joined = " ".join(texts)
        found: dict[tuple[int, int, str], Match] = {}
        for join in starts[1:]:
            low = max(0, join - 1 - ACROSS_CHARS)
            for m in self.profile.input.scan(joined[low : join + ACROSS_CHARS]):
                if low + m.start < join - 1 and low + m.end > join:  # it takes from both sides of the join
                    found.setdefault((low + m.start, low + m.end, m.detector.guard), Match(m.detector, low + m.start, low + m.end))
        pieces: dict[int, list[tuple[Match, str]]] = {}
        for match in sorted(found.values(), key=lambda m: (m.start, -m.end)):
            if match.action == "block":
                self._blocked(match, joined, param)
            self.note_match("input", match, joined)
            if match.action != "redact":
                continue
            first, last = bisect_right(starts, match.start) - 1, bisect_right(starts, match.end - 1) - 1
            name = self.placeholders.name(match.detector.label, joined[match.start : match.end])
            for i in range(first, last + 1):
                start, end = max(match.start, starts[i]) - starts[i], min(match.end, starts[i] + len(texts[i])) - starts[i]
                if end > start:
                    pieces.setdefault(i, []).append((Match(match.detector, start, end), name if i == first else ""))
        return pieces

    def check_prompt_tokens(self, tokens: int, param: str) -> None:
        limit = self.profile.profile.input.max_tokens if self.profile else None
        if limit is not None and tokens > limit:
            self.refuse("prompt_size", param, f"{tokens} tokens; the limit is {limit}")

    def refuse(self, guard: str, param: str, why: str) -> NoReturn:
        self.note("input", guard, "block")
        raise ContentPolicyViolation(f"The prompt was refused by the content policy: guard {guard} ({why})", param)

    async def moderate_input(self) -> None:
        """The moderation upstream's verdict on the prompt, when the profile asks for one."""
        if self.profile is None or self.profile.profile.input.moderation == "off" or not self.prompt_text:
            return
        with stage(current_trace(), "gateway.guards.moderation"):
            verdict = await self.moderate("input", self.prompt_text, self.profile.profile.input.moderation)
        if verdict == "block":
            raise ContentPolicyViolation("The prompt was refused by the content policy: guard moderation", None)

    async def moderate(self, stage: str, text: str, action: str) -> str | None:
        """"block", "flag" or None (passed), after counting and naming what happened."""
        assert self.moderation is not None
        verdict = await self.moderation.check(text)
        if verdict is None:
            self.note(stage, "moderation", "error")
            if not self.moderation.fail_closed:
                return None
            self.note(stage, "moderation", "block")
            if stage == "input":
                raise ServiceUnavailable("The moderation service is unavailable; the request was not served")
            return "block"
        if not verdict.flagged:
            return None
        self.note(stage, "moderation", action, ",".join(verdict.categories) or None)
        return action

    # --- on the way out -------------------------------------------------------------------

    def output(self, n: int, apart: bool = False, json: bool = False, tag: str | None = None) -> OutputGuard | None:
        """The guard of one generation of `n` choices (None: nothing to check or restore); `apart`:
        its logprobs are read in a slot of their own; `json`: its text is JSON; `tag`: its text is
        JSON after this tag (`OutputGuard`)."""
        if self.profile is None:
            return None
        restore = self.placeholders if self.profile.profile.input.restore else None
        if not self.checks_output and not (restore and self.placeholders):
            return None
        return OutputGuard(self, self.profile.output, self.profile.profile.output, restore, n, apart, json, tag)

    def weighed(self, entries: Sequence[TokenLogprob]) -> list[TokenLogprob]:
        """The logprobs of text the model read rather than wrote (an echoed prompt's), whose
        alternatives are still what the model weighed: those that would complete a match of the
        output checks, read after the text before them, are left out."""
        if self.profile is None or not self.profile.output:
            return list(entries)
        alternatives = LogprobFilter(self.profile.output, ALTERNATIVE_CONTEXT)
        alternatives.add(entries)
        return list(alternatives.release(0, everything=True))


UNGUARDED = RequestGuard(None)
