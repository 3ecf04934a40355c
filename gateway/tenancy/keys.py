"""Who is asking: the one decision, from a request's headers and address to an `Identity` or a
refusal (`Authenticator.identify`), without a web framework (`middleware.auth` calls it).

A key on every route but the open ones, as `Authorization: Bearer` (OpenAI's clients) or
`x-api-key` (Anthropic's). Keys come from settings and are kept only as SHA-256 hashes; a
presented key is hashed and compared with every stored hash in constant time. Exactly one key is
taken; two are a 401. Failed attempts are throttled per client address
(`auth_failures_per_minute`): past the limit every attempt from that address is refused with 429
until its bucket refills, so keys cannot be guessed at speed.

Each key has two names, neither of them the key: its *id*, a keyed hash (HMAC-SHA-256 with
`key_id_secret`, a random one per process when unset) that goes into logs and rate limits, and
its *tenant*, stable across processes, that scopes the response cache, stored responses and
sticky A/B splits and is never logged. Keys come from the keys file too (`tenancy.tenants`,
whose keys are named by their id there).

Without keys nothing proves that a request comes from a client and not from a web page the
client has open: a POST must then declare a JSON body (`Content-Type: application/json`), which
a page cannot send to another site without that site's CORS consent; anything else is a 415
(a POST without a body, such as a cancel, declares nothing).
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pydantic import SecretStr

from gateway.errors import AuthenticationFailed, RateLimited, UnsupportedMediaType
from gateway.telemetry import metrics
from gateway.tenancy.limits import TokenBucket
from gateway.tenancy.tenants import Tenants

ANONYMOUS = "anonymous"
Headers = Sequence[tuple[bytes, bytes]]  # a request's headers as the server read them (names lower-case)


@dataclass(frozen=True, slots=True)
class Identity:
    key_id: str  # safe to log: a keyed hash of the key
    tenant: str  # stable across processes, not logged: scopes the cache and sticky splits


NOBODY = Identity(ANONYMOUS, ANONYMOUS)


class KeyRing:
    def __init__(self, keys: Iterable[SecretStr], id_secret: SecretStr | None = None) -> None:
        self._hashes = [hashlib.sha256(k.get_secret_value().encode()).digest() for k in keys]
        self._id_secret = id_secret.get_secret_value().encode() if id_secret else os.urandom(32)
        # each stored key's names, computed once (an HMAC and a hash per request otherwise)
        self._identities = {
            digest: Identity(_key_id(digest, self._id_secret), hashlib.sha256(b"tenant\0" + digest).hexdigest())
            for digest in self._hashes
        }

    @property
    def enabled(self) -> bool:
        return bool(self._hashes)

    def identify(self, presented: str) -> Identity | None:
        """The key's names, or None for an unknown key."""
        digest = hashlib.sha256(presented.encode()).digest()
        found = None
        for stored in self._hashes:  # no early exit: the time taken does not depend on which key
            if hmac.compare_digest(stored, digest):
                found = stored
        return None if found is None else self._identities[found]


def _key_id(digest: bytes, secret: bytes) -> str:
    return hmac.new(secret, digest, hashlib.sha256).hexdigest()[:12]


def key_id(key: str, secret: str) -> str:
    """The id logs and the guards file name a key by, with `key_id_secret` set to `secret`."""
    return _key_id(hashlib.sha256(key.encode()).digest(), secret.encode())


class AttemptThrottle:
    """Failed key attempts per client address: a token bucket each (`per_minute`), at most
    `max_addresses` remembered (the least recently failing forgotten first)."""

    def __init__(self, per_minute: int, max_addresses: int = 10_000) -> None:
        self.per_minute = per_minute
        self.max_addresses = max_addresses
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def wait_s(self, address: str) -> float:
        """Seconds until `address` may try again (0: now)."""
        bucket = self._buckets.get(address)
        return 0.0 if bucket is None else bucket.wait_for(1)

    def failed(self, address: str) -> None:
        bucket = self._buckets.pop(address, None) or TokenBucket(float(self.per_minute))
        bucket.take(1)
        self._buckets[address] = bucket
        while len(self._buckets) > self.max_addresses:
            self._buckets.popitem(last=False)


def header_values(headers: Headers, name: bytes) -> list[bytes]:
    return [value for key, value in headers if key == name]


def _has_body(headers: Headers) -> bool:
    """Whether the request sends a body (a POST without one, e.g. a cancel, declares no type)."""
    length = header_values(headers, b"content-length")
    return bool(header_values(headers, b"transfer-encoding")) or any(value.strip() != b"0" for value in length)


def _declares_json(headers: Headers) -> bool:
    values = header_values(headers, b"content-type")
    return len(values) == 1 and values[0].split(b";")[0].strip().lower() == b"application/json"


def presented_keys(headers: Headers) -> list[str]:
    """The keys a request presents: its `Authorization` headers (a Bearer token each: OpenAI's
    clients; any other scheme counts as a wrong key), else its `x-api-key` headers (Anthropic's)."""
    authorization = header_values(headers, b"authorization")
    if authorization:
        schemes = [value.decode("latin-1").partition(" ") for value in authorization]
        return [token.strip() if scheme.lower() == "bearer" else "" for scheme, _, token in schemes]
    return [value.decode("latin-1").strip() for value in header_values(headers, b"x-api-key")]


class Authenticator:
    """Settings keys (`keys`), the keys file's (`tenants`) and the failed-attempt throttle."""

    def __init__(self, keys: KeyRing, throttle: AttemptThrottle, tenants: Tenants | None = None) -> None:
        self.keys = keys
        self.throttle = throttle
        self.tenants = tenants

    def identify(self, method: str, headers: Headers, address: str) -> Identity:
        """The request's identity, or the `APIError` that refuses it."""
        if not self.keys.enabled and not (self.tenants and self.tenants.enabled):
            if method == "POST" and _has_body(headers) and not _declares_json(headers):
                raise UnsupportedMediaType("Send the request body as JSON, with 'Content-Type: application/json'.")
            return NOBODY
        wait = self.throttle.wait_s(address)
        if wait > 0:
            metrics.labelled(metrics.RATE_LIMITED, "auth_failures").inc()
            raise RateLimited(
                "Too many failed API key attempts from this address; please try again later.",
                headers={"Retry-After": str(max(1, round(wait)))},
            )
        presented = presented_keys(headers)
        if not presented:
            raise AuthenticationFailed(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY' (or 'x-api-key: YOUR_KEY')."
            )
        # two keys: which one counts is for no layer to guess
        identity = self._lookup(presented[0]) if len(presented) == 1 and presented[0] else None
        if identity is None:
            self.throttle.failed(address)
            raise AuthenticationFailed("Incorrect API key provided.")
        return identity

    def _lookup(self, presented: str) -> Identity | None:
        """A keys-file key by the id the file gives it (its tenant the same, stable), else a settings key."""
        file_id = self.tenants.identify(presented) if self.tenants and self.tenants.enabled else None
        if file_id is not None:
            return Identity(file_id, f"keys-file:{file_id}")
        return self.keys.identify(presented)
