"""The guards' detectors (gateway.guards: pii, injection, patterns) and the streaming
window (stream.ChoiceFilter), without an app."""

from __future__ import annotations

import re

import pytest

from gateway.guards import injection, pii
from gateway.guards.config import OutputChecks, PIIChecks
from gateway.guards.patterns import Detector, Match, Placeholders, Scanner, regex_spans
from gateway.guards.stream import ChoiceFilter


def found(spans, text: str) -> list[str]:
    return [text[a:b] for a, b in spans(text)]


def test_emails() -> None:
    text = "write to bob.smith+news@mail.example.co.uk or ann@x.io, not to user@localhost or @handle"
    assert found(regex_spans(pii.EMAIL), text) == ["bob.smith+news@mail.example.co.uk", "ann@x.io"]


def test_card_numbers_need_the_luhn_check() -> None:
    text = "visa 4111 1111 1111 1111, amex 3782-822463-10005, typo 4111 1111 1111 1112, order 1234567890123"
    assert found(pii.card_spans, text) == ["4111 1111 1111 1111", "3782-822463-10005"]


def test_ibans_need_their_format_and_mod_97() -> None:
    text = "pay GB82 WEST 1234 5698 7654 32 or DE89370400440532013000, not GB82 WEST 1234 5698 7654 33 or XX12 3456"
    assert found(pii.iban_spans, text) == ["GB82 WEST 1234 5698 7654 32", "DE89370400440532013000"]


def test_ip_addresses_v4_and_v6() -> None:
    text = "hosts 192.168.1.20, 2001:db8::8a2e:370:7334 and ::1; not 999.1.1.1, 12:30:45, std::vector or v1.2.3"
    assert found(pii.ip_spans, text) == ["192.168.1.20", "2001:db8::8a2e:370:7334", "::1"]


def test_phone_numbers_by_libphonenumber() -> None:
    text = "call (415) 555-2671 or +44 20 7946 0958; not 2024-05-01, 3.14159 or order 12345"
    assert found(pii.phone_spans("US"), text) == ["(415) 555-2671", "+44 20 7946 0958"]
    assert found(pii.phone_spans(None), text) == ["+44 20 7946 0958"]  # no region: international only


def test_pii_detectors_follow_the_actions() -> None:
    kinds = {d.guard: d.action for d in pii.detectors(PIIChecks(email="redact", card="block"))}
    assert kinds["pii.email"] == "redact"
    assert kinds["pii.card"] == "block"
    assert kinds["pii.ip"] == "off"
    assert [d.guard for d in Scanner(pii.detectors(PIIChecks(email="redact"))).detectors] == ["pii.email"]


@pytest.mark.parametrize("pattern", injection.patterns(), ids=lambda p: p.id)
def test_each_injection_pattern_matches_its_examples(pattern: injection.InjectionPattern) -> None:
    assert pattern.examples
    assert pattern.source
    for example in pattern.examples:
        assert pattern.regex.search(example), example


BENIGN = [
    "What is the capital of France?",
    "Summarise this article about instruction tuning of language models.",
    "Don't forget the instructions for the assembly of the shelf.",
    "Please ignore typos in my question: how do I bake bread?",
    "Show me the system requirements for Windows 11.",
    "The new task scheduler in Linux is called EEVDF.",
    "Translate 'do anything' into French.",
    "Write a Python function that skips the header row of a CSV file.",
    "Our system: a Raspberry Pi with a camera. How do I stream video?",
    "![diagram](https://example.com/diagram.png)",
    "Repeat after me: the quick brown fox.",
    "What mode should the developer use for debugging?",
]


def test_ordinary_prompts_match_no_injection_pattern() -> None:
    for text in BENIGN:
        hits = [p.id for p in injection.patterns() if p.regex.search(text)]
        assert hits == [], (text, hits)


def test_allowed_spans_are_exempt() -> None:
    detectors = pii.detectors(PIIChecks(email="redact"))
    scanner = Scanner(detectors, allow=[r"support@example\.com"])
    matches = scanner.scan("mail support@example.com or eve@evil.example")
    assert [m.start for m in matches] == ["mail support@example.com or ".__len__()]


def test_placeholders_name_values_once_and_restore_them() -> None:
    names = Placeholders()
    assert names.name("EMAIL", "a@b.io") == "[EMAIL_1]"
    assert names.name("EMAIL", "c@d.io") == "[EMAIL_2]"
    assert names.name("EMAIL", "a@b.io") == "[EMAIL_1]"
    assert names.name("PHONE", "+1 415 555 2671") == "[PHONE_1]"
    assert names.restore("to [EMAIL_2], cc [EMAIL_1], [EMAIL_9] unknown") == "to c@d.io, cc a@b.io, [EMAIL_9] unknown"
    assert names.unfinished("write to [EMA") == len("write to ")
    assert names.unfinished("done [EMAIL_1]") == 14


def _filter(holdback: int = 8, window: int = 64, restore: Placeholders | None = None):
    deny = Detector("deny", "block", "DENY", regex_spans(re.compile(r"Paris")))
    email = Detector("pii.email", "redact", "EMAIL", regex_spans(pii.EMAIL))
    noted: list[tuple[str, str]] = []

    def note(match: Match, text: str) -> None:
        noted.append((match.detector.guard, text[match.start : match.end]))

    checks = OutputChecks(holdback_chars=holdback, window_chars=window)
    return ChoiceFilter(Scanner([deny, email]), checks, restore, note), noted


def feed_all(choice: ChoiceFilter, pieces: list[str]) -> list[str]:
    return [choice.feed(piece, final=i == len(pieces) - 1) for i, piece in enumerate(pieces)]


def test_a_match_spanning_chunks_is_cut_before_any_of_it_is_passed() -> None:
    choice, noted = _filter(holdback=8)
    out = feed_all(choice, ["The capital ", "of France ", "is Pa", "ris", ". It is"])
    assert "".join(out) == "The capital of France is "
    assert choice.cut
    assert choice.done
    assert noted == [("deny", "Paris")]
    assert out[-1] == ""


def test_without_holdback_the_window_still_catches_a_match_across_chunks() -> None:
    choice, _ = _filter(holdback=0)
    out = feed_all(choice, ["It is Pa", "ris", " indeed"])
    assert out[0] == "It is Pa"
    assert choice.cut
    assert "".join(out) == "It is Pa"


def test_redaction_waits_for_the_whole_match_and_restores_placeholders() -> None:
    names = Placeholders()
    names.name("EMAIL", "bob@example.com")
    choice, noted = _filter(holdback=16, restore=names)
    out = feed_all(choice, ["Mail eve@exa", "mple.org and [EMA", "IL_1] now"])
    assert "".join(out) == "Mail [EMAIL] and [EMAIL_1] now"  # restoring is the output guard's last step
    assert noted == [("pii.email", "eve@example.org")]
    assert not choice.cut
    assert names.restore("".join(out)) == "Mail [EMAIL] and bob@example.com now"


def test_a_holdback_shorter_than_a_match_redacts_what_was_not_passed_yet() -> None:
    choice, noted = _filter(holdback=4)
    out = feed_all(choice, ["Mail eve@exa", "mple.org", " and more text"])
    assert out[0] == "Mail eve"
    assert "".join(out) == "Mail eve[EMAIL] and more text"
    assert noted == [("pii.email", "@example.org")]


def test_a_placeholder_is_not_split_even_without_holdback() -> None:
    names = Placeholders()
    names.name("EMAIL", "bob@example.com")
    choice, _ = _filter(holdback=0, restore=names)
    out = feed_all(choice, ["Hi [EMA", "IL_1", "], bye"])
    assert out == ["Hi ", "", "[EMAIL_1], bye"]
