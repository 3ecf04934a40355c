"""Personal data in text: emails, phone numbers, payment card numbers, IBANs, IP addresses.

Candidates are found with patterns and kept only when they check out: card numbers pass the Luhn check and IBANs their
country's format and the mod-97 check (python-stdnum), IP addresses parse (`ipaddress`), and phone numbers are found and
validated by Google's libphonenumber rules (the `phonenumbers` port), which know every country's numbering plan."""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterator

import phonenumbers
from stdnum import iban, luhn

from gateway.guards.config import PIIChecks
from gateway.guards.normalize import pattern as spaced_pattern
from gateway.guards.patterns import Detector, Spans, regex_spans

EMAIL = re.compile(r"(?<![\w.+-])[A-Za-z0-9][A-Za-z0-9._%+-]*@[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9-]+)*\.[A-Za-z]{2,}\b")
# a space in these, as in every pattern, is any whitespace (normalize.pattern): a tab or a line break between digit groups
CARD = re.compile(spaced_pattern(r"(?<![\d-])\d(?:[ -]?\d){12,18}(?![\d-])"))
IBAN = re.compile(spaced_pattern(r"\b[A-Z]{2}\d{2}(?:[ -]?[A-Z0-9]){11,30}\b"))
PHONE_CANDIDATE = re.compile(r"(?:\+|\(|\b)\d[\d \t().\-/]{5,}\d(?:\s*(?:ext\.?|x|#)\s*\d+)?")
IPV4 = re.compile(r"(?<![\d.])(?:\d{1,3}\.){3}\d{1,3}(?![\d.])")
IPV6 = re.compile(r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?(?![\w:])")


def card_spans(text: str) -> Iterator[tuple[int, int]]:
    for match in CARD.finditer(text):
        digits = re.sub(r"[\s-]", "", match.group())
        if 13 <= len(digits) <= 19 and luhn.is_valid(digits):
            yield match.start(), match.end()


def iban_spans(text: str) -> Iterator[tuple[int, int]]:
    for match in IBAN.finditer(text):
        candidate = re.sub(r"\s", " ", match.group())
        # the pattern may run on into the next word group: try the longest valid prefix
        for end in range(len(candidate), 14, -1):
            if candidate[end - 1] not in " -" and iban.is_valid(candidate[:end]):
                yield match.start(), match.start() + end
                break


def ip_spans(text: str) -> Iterator[tuple[int, int]]:
    for pattern in (IPV4, IPV6):
        for match in pattern.finditer(text):
            value = match.group()
            if ":" in value and not any(c.isalnum() for c in value):
                continue  # "::" alone, or bare colons
            try:
                ipaddress.ip_address(value)
            except ValueError:
                continue
            yield match.start(), match.end()


def phone_spans(region: str | None) -> Spans:
    """libphonenumber's matcher, run only where a cheap pattern sees enough digits for a phone
    number: over a whole prompt it is slow."""

    def spans(text: str) -> Iterator[tuple[int, int]]:
        for candidate in PHONE_CANDIDATE.finditer(text):
            if sum(c.isdigit() for c in candidate.group()) < 7:
                continue
            for match in phonenumbers.PhoneNumberMatcher(candidate.group(), region):
                yield candidate.start() + match.start, candidate.start() + match.end

    return spans


def detectors(checks: PIIChecks) -> list[Detector]:
    """One detector per kind that is not off (cards and IBANs first: they win an overlap)."""
    spans: dict[str, tuple[str, Spans]] = {
        "card": ("CARD", card_spans),
        "iban": ("IBAN", iban_spans),
        "email": ("EMAIL", regex_spans(EMAIL)),
        "ip": ("IP", ip_spans),
        "phone": ("PHONE", phone_spans(checks.phone_region)),
    }
    return [Detector(f"pii.{kind}", getattr(checks, kind), label, find) for kind, (label, find) in spans.items()]
