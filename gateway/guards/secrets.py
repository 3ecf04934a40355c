"""Secrets in prompts: cloud credentials, service tokens, private keys, JSON Web Tokens, and high-entropy values assigned
to a key (`key=value`, `"key": "value"`).

Found by detect-secrets (Yelp), read in-process on the text: each of its regex plugins' own `denylist` (the patterns it
maintains) run once over the whole text with `finditer`, for positions (its `scan_line`, `analyze_line` and
`SecretsCollection` are line and file oriented, read global settings and may verify a secret over the network; its
`analyze_string` gives values without positions); its JWT check (`is_formally_valid`); its entropy measure
(`calculate_shannon_entropy` of Base64HighEntropyString and HexHighEntropyString, at their default limits) and its
heuristic filters (sequences, UUIDs, templates, ids). What detect-secrets 1.5 has no plugin for is in `EXTRA`, a short
list after gitleaks' rules (its config/gitleaks.toml, MIT): Google API keys and OAuth client secrets, Azure AD client
secrets, GitHub's fine-grained tokens, Anthropic keys, OpenAI's project, service-account and admin keys (whose
characters near its marker detect-secrets' pattern does not allow), and AWS secret keys written without quotes.

A secret is redacted whole: a match is widened over the token characters around it (detect-secrets' patterns stop at a
fixed length where newer keys run on, and its JWT pattern leaves the signature out), and a private key runs from its
`-----BEGIN` line to its `-----END` line (to the end of the text if none)."""

from __future__ import annotations

import re
from collections.abc import Iterator

from detect_secrets.filters import heuristic
from detect_secrets.plugins import keyword as keywords
from detect_secrets.plugins.artifactory import ArtifactoryDetector
from detect_secrets.plugins.aws import AWSKeyDetector
from detect_secrets.plugins.azure_storage_key import AzureStorageKeyDetector
from detect_secrets.plugins.base import RegexBasedDetector
from detect_secrets.plugins.discord import DiscordBotTokenDetector
from detect_secrets.plugins.github_token import GitHubTokenDetector
from detect_secrets.plugins.gitlab_token import GitLabTokenDetector
from detect_secrets.plugins.high_entropy_strings import Base64HighEntropyString, HexHighEntropyString
from detect_secrets.plugins.jwt import JwtTokenDetector
from detect_secrets.plugins.mailchimp import MailchimpDetector
from detect_secrets.plugins.npm import NpmDetector
from detect_secrets.plugins.openai import OpenAIDetector
from detect_secrets.plugins.private_key import PrivateKeyDetector
from detect_secrets.plugins.pypi_token import PypiTokenDetector
from detect_secrets.plugins.sendgrid import SendGridDetector
from detect_secrets.plugins.slack import SlackDetector
from detect_secrets.plugins.square_oauth import SquareOAuthDetector
from detect_secrets.plugins.stripe import StripeDetector
from detect_secrets.plugins.telegram_token import TelegramBotTokenDetector
from detect_secrets.plugins.twilio import TwilioKeyDetector

from gateway.guards.config import SecretChecks
from gateway.guards.patterns import Detector, Spans

Span = tuple[int, int]

EXTRA: dict[str, list[re.Pattern[str]]] = {  # after gitleaks' rules of the same names
    "aws": [re.compile(r"(?i)aws.{0,20}?(?:key|secret).{0,20}?[=:]\s*([A-Za-z0-9/+]{40})(?![A-Za-z0-9/+=])")],
    "google": [re.compile(r"AIza[\w-]{35}"), re.compile(r"GOCSPX-[\w-]{28}")],  # gcp-api-key, OAuth client secrets
    "azure": [re.compile(r"(?<![\w~.-])[\w~.]{3}\dQ~[\w~.-]{31,34}")],  # azure-ad-client-secret
    "github": [re.compile(r"github_pat_\w{82}")],  # github-fine-grained-pat
    "openai": [re.compile(r"sk-(?:proj|svcacct|admin)-[\w-]{58,74}T3BlbkFJ[\w-]{58,74}")],  # openai-api-key: newer
    "anthropic": [re.compile(r"sk-ant-(?:api03|admin01)-[\w-]{93}AA")],  # anthropic-api-key, -admin-api-key
}
PLUGINS: dict[str, tuple[str, list[type[RegexBasedDetector]]]] = {  # kind: the placeholder's word, its plugins
    "aws": ("AWS_KEY", [AWSKeyDetector]),
    "google": ("GOOGLE_KEY", []),
    "azure": ("AZURE_KEY", [AzureStorageKeyDetector]),
    "github": ("GITHUB_TOKEN", [GitHubTokenDetector]),
    "gitlab": ("GITLAB_TOKEN", [GitLabTokenDetector]),
    "slack": ("SLACK_TOKEN", [SlackDetector]),
    "stripe": ("STRIPE_KEY", [StripeDetector]),
    "openai": ("OPENAI_KEY", [OpenAIDetector]),
    "anthropic": ("ANTHROPIC_KEY", []),
    "private_key": ("PRIVATE_KEY", [PrivateKeyDetector]),
    "jwt": ("JWT", [JwtTokenDetector]),
    "other": ("TOKEN", [ArtifactoryDetector, DiscordBotTokenDetector, MailchimpDetector, NpmDetector, PypiTokenDetector,
                        SendGridDetector, SquareOAuthDetector, TelegramBotTokenDetector, TwilioKeyDetector]),
}
TOKEN = re.compile(r"[\w+/=.~-]*")  # what a token is made of: a match is widened over it
BEFORE = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")  # ... to the left over fewer
PEM_END = re.compile(r"-----END[ A-Z0-9]*-----|Private-MAC: *[0-9a-f]+")
PEM_TAIL = re.compile(r"-----END[ A-Z0-9]*PRIVATE KEY(?: BLOCK)?-----")
# detect-secrets' patterns that backtrack over a whole run of characters from each place they may begin (quadratic in a
# long run): tried once per run, from where they may begin first in it (if they fail there, they fail anywhere later in
# the run, as the run is all their unbounded part may take)
RUNS: dict[re.Pattern[str], tuple[re.Pattern[str], re.Pattern[str]]] = {
    OpenAIDetector.denylist[0]: (re.compile("sk-"), re.compile(r"[A-Za-z0-9_-]*")),
    JwtTokenDetector.denylist[0]: (re.compile("eyJ"), re.compile(r"[A-Za-z0-9_=-]*")),
    NpmDetector.denylist[0]: (re.compile("//"), re.compile(r"[^\n]*")),
}
# A value assigned to a key: `key=value`, `key: value`, `"key": "value"` (the key quoted or not, the value too); found
# from its operator, which is quick to look for, and then its key, read back from there (the value possessive, and `=`
# in it only as padding: a failed match gives nothing back)
ASSIGNMENT = re.compile(r"""(?::=|=>|[=:])\s{0,3}(["']?)([A-Za-z0-9+/_-]{12,}+={0,2}+)\1(?![A-Za-z0-9+/=_.-])""")
KEY = re.compile(r"""(?<![\w.-])(["']?)([A-Za-z_][\w.-]{0,63})\1\s{0,3}$""")
KEYWORD = re.compile("|".join(keywords.DENYLIST))  # read on the text in small letters: quick where (?i) is slow
KEYWORD_BEFORE = (keywords.PRECEDED_BY_EQUAL_COMPARISON_SIGNS_QUOTES_REQUIRED_REGEX,
                  keywords.QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP[keywords.PRECEDED_BY_EQUAL_COMPARISON_SIGNS_QUOTES_REQUIRED_REGEX])
WORD = re.compile(r"\w*")
# how far past its keyword's run a keyword pattern reads, as far as the one before reads back: a quoted value on a long
# line of backticks is read to the line's end (a quote may be inside it) from up to 50 places, once per keyword
AFTER_CHARS = 256
OPERATOR_BEFORE = re.compile(r"[!=]{2}\s*\w*$")  # what the one before needs before its keyword: tried only there
KEYWORD_AFTER = [(p, g) for p, g in keywords.QUOTES_REQUIRED_DENYLIST_REGEX_TO_GROUP.items() if p is not KEYWORD_BEFORE[0]]
# a key naming a digest (a part of it: `sha256`, `file_md5`, `etag`), whose value is not a secret; `hashicorp_token` is
DIGEST_KEY = re.compile(r"(?i)(?:^|[_.-])(?:sha\d*|md5|hash|digest|checksum|etag|commit|integrity|fingerprint)(?:$|[_.-])")
BASE64, HEX = Base64HighEntropyString(), HexHighEntropyString()


def widened(text: str, start: int, end: int) -> Span:
    """The span grown over the token it sits in (a trailing full stop is prose, left out)."""
    low = max(0, start - 256)
    while start > low and text[start - 1] in BEFORE:
        start -= 1
    after = TOKEN.match(text, end)
    end = after.end() if after else end
    while end > start + 1 and text[end - 1] == ".":
        end -= 1
    return start, end


def finditer(pattern: re.Pattern[str], text: str) -> Iterator[re.Match[str]]:
    """The pattern's matches, as `pattern.finditer`; the patterns of `RUNS` tried once per run."""
    if pattern not in RUNS:
        yield from pattern.finditer(text)
        return
    lead, run = RUNS[pattern]
    at = 0
    while (begin := lead.search(text, at)) is not None:
        match = pattern.match(text, begin.start())
        if match:
            yield match
            at = max(match.end(), begin.start() + 1)
        else:
            after = run.match(text, begin.end())
            at = after.end() + 1 if after else begin.end()


def regex_matches(pattern: re.Pattern[str], text: str) -> Iterator[Span]:
    """What detect-secrets reports of each match (its groups if it has any, else the match), as spans."""
    for match in finditer(pattern, text):
        groups = [i for i in range(1, pattern.groups + 1) if match.group(i)]
        yield from ((match.start(i), match.end(i)) for i in groups) if groups else [match.span()]


def jwt_start(text: str, start: int, end: int) -> int:
    """Where the JWT of a match that is not one begins (-1: nowhere): a prefix glued to it (`eyJeyJhbGci...`) makes
    the match begin early, at an `eyJ` of its own header; a header is short, so only its last 2 KB are tried."""
    dot = text.find(".", start, end)
    at = text.find("eyJ", max(start + 1, dot - 2048), dot)
    while at >= 0 and not JwtTokenDetector.is_formally_valid(text[at:end]):
        at = text.find("eyJ", at + 1, dot)
    return at


def plugin_spans(plugins: list[type[RegexBasedDetector]], extra: list[re.Pattern[str]]) -> Spans:
    patterns = [p for plugin in plugins for p in plugin.denylist] + extra  # type: ignore[attr-defined]
    jwt, pem = JwtTokenDetector in plugins, PrivateKeyDetector in plugins

    def spans(text: str) -> Iterator[Span]:
        for pattern in patterns:
            covered = 0  # a match inside the last span found is part of it
            for start, end in regex_matches(pattern, text):
                if jwt and start >= covered and not JwtTokenDetector.is_formally_valid(text[start:end]):
                    start = jwt_start(text, start, end)
                if start < covered:
                    continue
                if pem:  # the whole block, from its "-----BEGIN" ("BEGIN ... PRIVATE KEY" is what matched)
                    block_end = PEM_END.search(text, end)
                    start, end = start - 5 if text.endswith("-----", 0, start) else start, block_end.end() if block_end else len(text)
                else:
                    start, end = widened(text, start, end)
                covered = end
                yield start, end
        if pem and (tail := PEM_TAIL.search(text)) and "-----BEGIN" not in text[: tail.start()]:
            yield 0, tail.end()  # a block's end whose beginning is in an earlier text (a key sent in two parts)

    return spans


def high_entropy(value: str) -> bool:
    """detect-secrets' measure: hex above its limit, else base64 above its (and none of its false positives)."""
    if heuristic.is_sequential_string(value) or heuristic.is_potential_uuid(value) or heuristic.is_not_alphanumeric_string(value):
        return False
    if all(c in HEX.charset for c in value):
        return HEX.calculate_shannon_entropy(value) > HEX.entropy_limit
    return BASE64.calculate_shannon_entropy(value) > BASE64.entropy_limit


def entropy_spans(text: str) -> Iterator[Span]:
    """High-entropy values assigned to a key; ids and digests are not secrets."""
    for match in ASSIGNMENT.finditer(text):
        key = KEY.search(text, max(0, match.start() - 72), match.start())
        value = match.group(2)
        if key and high_entropy(value) and not DIGEST_KEY.search(key.group(2)) and \
                not heuristic.is_likely_id_string(value, text[key.start() : match.end()]):
            yield match.start(2), match.end(2)


def keyword_spans(text: str) -> Iterator[Span]:
    """Any value in quotes assigned to a secret-named key (detect-secrets' KeywordDetector: `password = "..."`,
    `"api_key": "..."`), but templates (`"${TOKEN}"`, `"<password>"`). Its patterns are tried only where one of its
    keywords is, and on that line, as it reads them: over a whole prompt they are slow (case-insensitive alternations
    tried at every character)."""
    lowered = text.lower()
    if len(lowered) != len(text):  # a letter whose small form is longer: positions in `lowered` are not `text`'s
        lowered = "".join(c if len(c.lower()) != 1 else c.lower() for c in text)
    start = end = 0  # the line of the keyword (found once per line: a line may hold thousands)
    compares = False
    tried = [0] * len(KEYWORD_AFTER)  # per pattern, the end of the word run it was last tried from
    for word in KEYWORD.finditer(lowered):
        if word.start() >= end:
            start, end = text.rfind("\n", 0, word.start()) + 1, text.find("\n", word.start())
            end = len(text) if end < 0 else end
            compares = "==" in text[start:end] or "!=" in text[start:end]
        found = []
        if word.start() >= min(tried):  # a pattern is tried from it: where its run ends (read once per run)
            run = WORD.match(text, word.start())
            run_end = run.end() if run else end
        for i, (pattern, group) in enumerate(KEYWORD_AFTER):
            # each begins `keyword\w*`, and what follows reads on from where `\w*` stops: from a later keyword of the
            # same run of word characters (`secret_secret_...`) it finds what it found from the first, or nothing,
            # after going over the rest of the run again
            match = None
            if word.start() >= tried[i]:
                match, tried[i] = pattern.match(text, word.start(), min(end, run_end + AFTER_CHARS)), run_end
            found.append((match, group))
        if compares and OPERATOR_BEFORE.search(text, max(start, word.start() - 256), word.start()):
            found.append((KEYWORD_BEFORE[0].search(text, max(start, word.start() - 256), word.end() + 64), KEYWORD_BEFORE[1]))
        for match, group in found:
            value = match.group(group) if match else ""
            if match and not heuristic.is_templated_secret(value) and not heuristic.is_prefixed_with_dollar_sign(value):
                yield match.start(group), match.end(group)


def detectors(checks: SecretChecks) -> list[Detector]:
    """One detector per kind that is not off."""
    found = [Detector(f"secrets.{kind}", getattr(checks, kind), label, plugin_spans(plugins, EXTRA.get(kind, [])))
             for kind, (label, plugins) in PLUGINS.items()]
    return [*found, Detector("secrets.high_entropy", checks.high_entropy, "SECRET", entropy_spans),
            Detector("secrets.keyword", checks.keyword, "SECRET", keyword_spans)]
