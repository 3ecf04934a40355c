"""Text as the guards read it: what the model reads, without the disguises that only fool a regex.

`normalize(text)` is the one normalization every guard uses, and patterns are read through it too (`pattern`), so a
pattern and its text are in the same form. Per character: Unicode NFKC; letters in boxes, circles and small capitals
that NFKC leaves are the letter; format and invisible characters and decorating marks are removed (accents stay, as
Unicode TR39 keeps them); TR39's one-letter confusables become the Latin letter; every space is a space, every dash a
hyphen-minus, every digit an ASCII digit; and JSON's `\\uXXXX` escapes are the character they name (tool-call arguments
are JSON their reader decodes). A pattern's literal space takes any run of whitespace (`spaced`: done to the pattern,
so that the text keeps its lines). A match is mapped back to the original (`Normalized.span`), so the client's text is
redacted where the value really is.

A table of our own for the confusables: the PyPI packages on them detect mixed scripts or expand a string into its
variants; none maps a character to one skeleton character with its position kept, which redaction needs. ASCII text is
its own normalization (no copy, no offset map)."""

from __future__ import annotations

import json
import re
import unicodedata
from bisect import bisect_right
from collections.abc import Callable
from functools import lru_cache

# One letter → one Latin letter, after TR39 confusables.txt (its entries whose target is one Latin letter). Where TR39
# maps a capital only (Cyrillic К, Н, Т, М, В), its small letter is mapped to the same letter's small form, so that a
# case-insensitive pattern written in that script still matches either case once both are normalized; Greek η, ν, μ look
# like other letters than their capitals do, and follow TR39 (η → n, ν → v, μ unchanged).
CONFUSABLES = {
    # Cyrillic
    "А": "A", "а": "a", "В": "B", "в": "b", "Е": "E", "е": "e", "К": "K", "к": "k", "М": "M", "м": "m",
    "Н": "H", "н": "h", "О": "O", "о": "o", "Р": "P", "р": "p", "С": "C", "с": "c", "Т": "T", "т": "t",
    "Х": "X", "х": "x", "У": "Y", "у": "y", "Ү": "Y", "ү": "y", "Ѕ": "S", "ѕ": "s", "І": "I", "і": "i",
    "Ї": "I", "ї": "i", "Ј": "J", "ј": "j", "Һ": "H", "һ": "h", "Ԁ": "D", "ԁ": "d", "Ԛ": "Q", "ԛ": "q",
    "Ԝ": "W", "ԝ": "w", "Ӏ": "I", "ӏ": "l", "Ԍ": "G", "ԍ": "g",
    # Greek
    "Α": "A", "α": "a", "Β": "B", "β": "b", "Ε": "E", "ε": "e", "Ζ": "Z", "ζ": "z", "Η": "H", "η": "n",
    "Ι": "I", "ι": "i", "Κ": "K", "κ": "k", "Μ": "M", "Ν": "N", "ν": "v", "Ο": "O", "ο": "o", "Ρ": "P",
    "ρ": "p", "Τ": "T", "τ": "t", "Υ": "Y", "υ": "u", "Χ": "X", "χ": "x", "Ϲ": "C", "ϲ": "c", "Ϳ": "J",
    "ϳ": "j", "ϒ": "Y",
    # Armenian
    "Օ": "O", "օ": "o", "Ս": "U", "ս": "u", "հ": "h", "ո": "n", "ց": "g", "զ": "q",
    # Cherokee (capitals)
    "Ꭺ": "A", "Ᏼ": "B", "Ꮯ": "C", "Ꭼ": "E", "Ꮐ": "G", "Ꮋ": "H", "Ꭻ": "J", "Ꮶ": "K", "Ꮇ": "M",
    "Ꮲ": "P", "Ꮪ": "S", "Ꭲ": "T", "Ꮩ": "V", "Ꮃ": "W", "Ꮓ": "Z",
    # Latin letters that stand in for plainer ones
    "ı": "i", "ȷ": "j", "ɑ": "a", "ɡ": "g", "ɩ": "i", "ʏ": "y", "ᴄ": "c", "ᴏ": "o", "ᴠ": "v", "ᴡ": "w", "ᴢ": "z",
    # small capitals (the "fancy text" of letter generators; NFKC leaves them)
    "ᴀ": "a", "ʙ": "b", "ᴅ": "d", "ᴇ": "e", "ꜰ": "f", "ɢ": "g", "ʜ": "h", "ɪ": "i", "ᴊ": "j", "ᴋ": "k", "ʟ": "l",
    "ᴍ": "m", "ɴ": "n", "ᴘ": "p", "ʀ": "r", "ꜱ": "s", "ᴛ": "t", "ᴜ": "u",
}
# Letters drawn in a box or a circle, or as flag halves, that NFKC leaves as symbols (or makes "(a)"
# of): read as the letter, before NFKC.
ENCLOSED = {
    **{0x1F1E6 + i: chr(65 + i) for i in range(26)},  # regional indicators (🇦)
    **{0x1F150 + i: chr(65 + i) for i in range(26)},  # negative circled (🅐)
    **{0x1F170 + i: chr(65 + i) for i in range(26)},  # negative squared (🅰)
    **{0x249C + i: chr(97 + i) for i in range(26)},  # parenthesized (⒜)
}
DROPPED = frozenset(
    "\u034f"  # combining grapheme joiner
    "\u17b4\u17b5"  # Khmer inherent vowels (invisible)
    "\u0305\u0332\u0333\u0334\u0335\u0336\u0337\u0338\u033f"  # overlines, low lines, overlays: decoration
    "\u115f\u1160\u3164\uffa0"  # Hangul fillers
    "\u180b\u180c\u180d\u180f"  # Mongolian variation selectors
    + "".join(chr(c) for c in range(0xFE00, 0xFE10))  # variation selectors
    + "".join(chr(c) for c in range(0xE0100, 0xE01F0))
    + "".join(chr(c) for c in range(0x20D0, 0x20F1))  # combining marks for symbols (enclosing circles, ...)
)
SPACES = frozenset("\u2800")  # the Braille blank looks like a space; Zs covers the rest
DASHES = frozenset("\u2212\u2043\u02d7\u2796\ufe63")  # minus signs and hyphen bullets; Pd covers the rest
_NON_ASCII = re.compile(r"[^\x00-\x7f]+")
_ESCAPE = r"\\u[dD][89abAB][0-9a-fA-F]{2}\\u[dD][c-fC-F][0-9a-fA-F]{2}|\\u[0-9a-fA-F]{4}"  # JSON's, a pair first
_SPECIAL = re.compile(rf"[^\x00-\x7f]+|{_ESCAPE}")


@lru_cache(maxsize=8192)
def fold(chunk: str) -> str:
    """One character (with the marks that combine with it) as the guards read it."""
    out = []
    for char in unicodedata.normalize("NFKC", chunk.translate(ENCLOSED)):
        category = unicodedata.category(char)
        if category in ("Cf", "Me") or char in DROPPED:
            continue
        char = CONFUSABLES.get(char, char)
        if category == "Zs" or char in SPACES:
            char = " "
        elif category == "Pd" or char in DASHES:
            char = "-"
        elif category == "Nd":
            char = str(unicodedata.decimal(char))
        elif category in ("Zl", "Zp"):
            char = "\n"
        out.append(char)
    return "".join(out)


class Normalized:
    """A text as the guards read it (`text`), and the way back to the original (`span`)."""

    __slots__ = ("_exact", "_norm", "_orig", "_orig_end", "original", "text")

    def __init__(self, original: str, text: str, segments: list[tuple[int, int, int, bool]] | None = None) -> None:
        self.original, self.text = original, text
        # None: the text is its own normalization. Else, per segment of the normalized text: where
        # it starts there and in the original, where it ends in the original, and whether it maps
        # one character to one (else any position in it maps to the whole original segment).
        self._norm = [s[0] for s in segments] if segments is not None else None
        self._orig = [s[1] for s in segments] if segments is not None else []
        self._orig_end = [s[2] for s in segments] if segments is not None else []
        self._exact = [s[3] for s in segments] if segments is not None else []

    def span(self, start: int, end: int) -> tuple[int, int]:
        """The original span of the normalized span [start, end) (non-empty): from the beginning
        of the original character that made `start` to the end of the one that made `end - 1`,
        the characters removed inside it and right after it included."""
        if self._norm is None:
            return start, end
        i = bisect_right(self._norm, start) - 1
        first = self._orig[i] + (start - self._norm[i]) if self._exact[i] else self._orig[i]
        j = bisect_right(self._norm, end - 1) - 1
        last = self._orig[j] + (end - self._norm[j]) if self._exact[j] else self._orig_end[j]
        if last == self._orig_end[j]:  # the invisible characters right after it go with it (a trailing selector)
            last = self._orig[j + 1] if j + 1 < len(self._orig) else len(self.original)
        return first, last

    def position(self, index: int) -> int:
        """The original position of the normalized position `index` (a character boundary there)."""
        if self._norm is None:
            return index
        if index >= len(self.text):
            return len(self.original)
        return self.span(index, index + 1)[0]


class _Folds(dict[int, str]):
    """`fold` of each character seen, by code point: a table for `str.translate`, filled as it is
    read (the characters of Unicode bound it)."""

    def __missing__(self, code: int) -> str:
        folded = self[code] = fold(chr(code))
        return folded


_FOLDS = _Folds()


class _Built:
    """The normalized text as it is made: its parts, and its segments (normalized start, original
    start, original end, one to one)."""

    __slots__ = ("parts", "segments", "size")

    def __init__(self) -> None:
        self.parts: list[str] = []
        self.segments: list[tuple[int, int, int, bool]] = []
        self.size = 0  # of the normalized text so far

    def keep(self, original_start: int, original_end: int, out: str) -> None:
        if not out:
            return  # removed: the characters fall between two segments
        one_to_one = len(out) == original_end - original_start
        segments = self.segments
        last = segments[-1] if segments else None
        if one_to_one and last is not None and last[3] and last[2] == original_start:
            segments[-1] = (last[0], last[1], original_end, True)
        else:
            segments.append((self.size, original_start, original_end, one_to_one))
        self.parts.append(out)
        self.size += len(out)


def normalize(text: str, escapes: bool = True) -> Normalized:
    """The text as every guard reads it (see the module's docstring), with its way back;
    `escapes`: JSON's \\u escapes read as the characters they name."""
    escaped = escapes and "\\u" in text
    if text.isascii() and not escaped:
        return Normalized(text, text)
    composed = unicodedata.is_normalized("NFC", text)  # nothing for NFKC to compose across characters
    if not escaped and composed and len(text.encode("utf-8", "surrogatepass")) - len(text) > len(text) // 8:
        # much of it is not ASCII (another script): folded at once, in C, when nothing is removed or expanded
        folded = text.translate(_FOLDS)
        if len(folded) == len(text):
            return Normalized(text, folded, [(0, 0, len(text), True)])
    built = _Built()
    keep = built.keep

    at = 0
    for run in (_SPECIAL if escaped else _NON_ASCII).finditer(text):
        begin = run.start()
        if text[begin] == "\\" and text.startswith("\\u", begin):  # an escape: the character it names
            keep(at, begin, text[at:begin])
            keep(begin, run.end(), fold(json.loads(f'"{run.group()}"')))
            at = run.end()
            continue
        if begin > at and unicodedata.combining(text[begin]):
            begin -= 1  # a mark on the ASCII letter before it: the two compose
        keep(at, begin, text[at:begin])
        chars = text[begin : run.end()]
        folded = chars.translate(_FOLDS)  # per character, in C: the common case
        if len(folded) == len(chars) and (composed or unicodedata.is_normalized("NFC", chars)):
            keep(begin, run.end(), folded)
        else:  # characters removed or expanded, or marks to compose: one character (and its marks) at a time
            start = begin
            for i in range(begin + 1, run.end() + 1):
                if i == run.end() or not unicodedata.combining(text[i]):
                    keep(start, i, fold(text[start:i]))
                    start = i
        at = run.end()
    keep(at, len(text), text[at:])
    return Normalized(text, "".join(built.parts), built.segments)


def pattern(source: str) -> str:
    """A regular expression's source read the same way as the text it is matched on: its literal letters, spaces, dashes
    and digits (a pattern is ASCII nearly always: then as it is), and each of its literal spaces taking any run of
    whitespace (`spaced`). Its \\u escapes are the regex's own, kept."""
    return spaced(normalize(source, escapes=False).text)


_QUANTIFIED = re.compile(r"\{\d*,?\d*\}")
_CLASS_OPENING = re.compile(r"\[\^?\]?")  # a class's `[`, its `^`, and a `]` that is its first member


def _whitespace(source: str, at: int, space_at: Callable[[int], int]) -> tuple[str, int]:
    """What the run of literal spaces at `at` becomes (`space_at`: the length of the one at a place), with the
    quantifier after it, and where the pattern goes on."""
    run, width = 0, space_at(at)
    while width:
        at, run, width = at + width, run + 1, space_at(at + width)
    following = source[at : at + 1]
    if following in ("?", "*", "+"):
        return ("\\s*" if run == 1 and following != "+" else "\\s+"), at + 1
    return ("\\s" if run == 1 and _QUANTIFIED.match(source, at) else "\\s+"), at


def _class_space(source: str, start: int, end: int, opened: int) -> str:
    """A literal space in a class whose members begin at `opened`: any whitespace character, unless an end of a range
    (`[ -~]`), which stays a space."""
    ranged = (source.startswith("-", end) and not source.startswith("-]", end)) or source.endswith("-", opened + 1, start)
    return source[start:end] if ranged else "\\s"


def _group(source: str, at: int, behind: list[bool], in_class: bool) -> None:
    """`behind` kept as a group opens or closes at `at` (not in a class): whether each open group is in a lookbehind."""
    if in_class:
        return
    if source[at] == "(":
        behind.append(behind[-1] or source.startswith(("(?<=", "(?<!"), at))
    elif source[at] == ")" and len(behind) > 1:
        behind.pop()


def spaced(source: str) -> str:
    """The regular expression with its literal spaces (a space, `\\ `; in verbose mode only `\\ ` and a class's) made
    whitespace: a run of them matches any run of whitespace (`\\s+`: tabs, line breaks, NEL, U+2028, U+2029 and the
    Unicode spaces), a space quantified by `?` or `*` any run or none, one in a class any whitespace character. The
    text is left as it is, so that line breaks stay line breaks for the patterns that mean them (`\\n`, `(?m)^`), and
    ASCII text keeps costing nothing to normalize. A lone space followed by `{m,n}` is one whitespace character, repeated,
    and a space in a lookbehind one whitespace character (a lookbehind has a fixed width)."""
    if " " not in source:
        return source
    verbose = bool(re.compile(source).flags & re.VERBOSE)

    def space_at(at: int) -> int:
        """The length of the literal space at `at` (0: none there)."""
        if source.startswith("\\ ", at):
            return 2
        return 1 if source.startswith(" ", at) and (in_class or not verbose) else 0

    out: list[str] = []
    i, in_class, opened = 0, False, 0  # opened: where the class's members begin
    behind = [False]  # per open group (the pattern first), whether it is in a lookbehind, which keeps a fixed width
    while i < len(source):
        if (in_class or behind[-1]) and (width := space_at(i)):  # one whitespace character a space
            out.append(_class_space(source, i, i + width, opened) if in_class else "\\s")
            i += width
        elif space_at(i):
            whitespace, i = _whitespace(source, i, space_at)
            out.append(whitespace)
        elif source[i] == "\\":
            out.append(source[i : i + 2])
            i += 2
        elif source[i] == "#" and verbose and not in_class:  # a comment, to the end of its line
            end = len(source) if (end := source.find("\n", i)) < 0 else end
            out.append(source[i:end])
            i = end
        elif source[i] == "[" and not in_class:
            opening = _CLASS_OPENING.match(source, i)
            assert opening is not None
            out.append(opening.group())
            i, in_class, opened = opening.end(), True, opening.end()
        else:
            _group(source, i, behind, in_class)
            in_class = in_class and source[i] != "]"
            out.append(source[i])
            i += 1
    return "".join(out)
