"""Who is asking: from a request's headers and address to an `Identity` or a refusal (`Authenticator.identify`),
without a web framework."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import os
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

from pydantic import SecretStr

from gateway.errors import AuthenticationFailed, RateLimited, UnsupportedMediaType
from gateway.settings import Settings
from gateway.telemetry import metrics
from gateway.tenancy.limits import TokenBucket
from gateway.tenancy.tenants import Tenants, find

ANONYMOUS = "anonymous"
Headers = Sequence[tuple[bytes, bytes]]  # a request's headers as the server read them (names lower-case)


@dataclass(frozen=True, slots=True)
class Identity:
    key_id: str  # safe to log: a keyed hash of the key
    tenant: str  # stable across processes, not logged: scopes the cache and sticky splits


NOBODY = Identity(ANONYMOUS, ANONYMOUS)


class KeyRing:
    def __init__(self, keys: Iterable[SecretStr], id_secret: SecretStr | None = None) -> None:
        secret = id_secret.get_secret_value().encode() if id_secret else os.urandom(32)
        # each stored key's names, computed once (an HMAC and a hash per request otherwise)
        self._identities = [
            (digest, Identity(_key_id(digest, secret), hashlib.sha256(b"tenant\0" + digest).hexdigest()))
            for digest in (hashlib.sha256(k.get_secret_value().encode()).digest() for k in keys)
        ]
        self.by_tenant = {identity.tenant: identity for _, identity in self._identities}

    @property
    def enabled(self) -> bool:
        return bool(self._identities)

    def identify(self, presented: str) -> Identity | None:
        return find(self._identities, presented)


def _key_id(digest: bytes, secret: bytes) -> str:
    return hmac.new(secret, digest, hashlib.sha256).hexdigest()[:12]


def key_id(key: str, secret: str) -> str:
    """The id logs and the guards file name a key by (HMAC with `key_id_secret`), never the key."""
    return _key_id(hashlib.sha256(key.encode()).digest(), secret.encode())


class AttemptThrottle:
    """Failed key attempts per client address, a token bucket each, at most `max_addresses` remembered. Known keys are
    looked up first, so one client sending bad keys cannot lock out tenants sharing its address."""

    def __init__(self, per_minute: int, max_addresses: int = 10_000) -> None:
        self.per_minute = per_minute
        self.max_addresses = max_addresses
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()

    def wait_s(self, address: str) -> float:
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
    length = header_values(headers, b"content-length")
    return bool(header_values(headers, b"transfer-encoding")) or any(value.strip() != b"0" for value in length)


def _declares(headers: Headers, media_type: bytes) -> bool:
    values = header_values(headers, b"content-type")
    return len(values) == 1 and values[0].split(b";")[0].strip().lower() == media_type


def _declares_upload(headers: Headers) -> bool:
    """A multipart form with a credential header: a web page cannot add one to a cross-site form."""
    credential = header_values(headers, b"authorization") or header_values(headers, b"x-api-key")
    return _declares(headers, b"multipart/form-data") and bool(credential)


def presented_keys(headers: Headers) -> set[str]:
    """The different keys a request presents (each Bearer token, any other scheme as "", and each `x-api-key`): two
    different ones are a 401."""
    keys = set()
    for value in header_values(headers, b"authorization"):
        scheme, _, token = value.decode("latin-1").partition(" ")
        keys.add(token.strip() if scheme.lower() == "bearer" else "")
    keys.update(value.decode("latin-1").strip() for value in header_values(headers, b"x-api-key"))
    return keys


ForwardedHeader = Literal["x-forwarded-for", "forwarded"]
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class TrustedProxies:
    """Which peers may name the client, and by which header. The client is the nearest hop that is not a trusted
    proxy, read from the right."""

    def __init__(self, spec: str = "", header: ForwardedHeader = "x-forwarded-for") -> None:
        entries = [entry.strip() for entry in spec.split(",") if entry.strip()]
        self.any = "*" in entries
        self.networks: list[Network] = [ipaddress.ip_network(e, strict=False) for e in entries if e != "*"]
        self.header = header

    def trusts(self, address: str) -> bool:
        if self.any:
            return True
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None  # ::ffff:10.0.0.1 (a dual-stack socket)
        return any(ip in network or (mapped is not None and mapped in network) for network in self.networks)

    def client(self, peer: str, headers: Headers) -> str:
        if not (self.any or self.networks) or not self.trusts(peer):
            return peer
        hops = _forwarded_for(headers) if self.header == "forwarded" else _x_forwarded_for(headers)
        for hop in reversed(hops):
            if not self.trusts(hop):
                return hop
        return hops[0] if hops else peer


def _x_forwarded_for(headers: Headers) -> list[str]:
    """Each hop of `X-Forwarded-For`, without brackets or port (some balancers add a port per connection, which would
    make each one a new client)."""
    values = b",".join(header_values(headers, b"x-forwarded-for")).decode("latin-1")
    return [_node(hop.strip()) for hop in values.split(",") if hop.strip()]


def _forwarded_for(headers: Headers) -> list[str]:
    hops = []
    for element in b",".join(header_values(headers, b"forwarded")).decode("latin-1").split(","):
        for pair in element.split(";"):
            name, _, value = pair.strip().partition("=")
            if name.lower() == "for" and value:
                hops.append(_node(value.strip().strip('"')))
    return hops


def _node(value: str) -> str:
    """`192.0.2.1:80` → `192.0.2.1`, `[2001:db8::1]:80` → `2001:db8::1`; others as they are."""
    if value.startswith("["):
        return value[1:].partition("]")[0]
    host, sep, port = value.rpartition(":")
    return host if sep and port.isdigit() and ":" not in host else value


class Authenticator:
    """Settings keys, the keys file's keys, and the failed-attempt throttle. Without keys, a POST must declare JSON
    (or be a credentialed upload), which a web page cannot send cross-site."""

    def __init__(self, keys: KeyRing, throttle: AttemptThrottle, tenants: Tenants | None,
                 proxies: TrustedProxies) -> None:
        self.keys, self.throttle, self.proxies = keys, throttle, proxies
        self.tenants = tenants if tenants is not None and tenants.enabled else None  # the keys file, when there is one
        self.keyed = keys.enabled or self.tenants is not None

    def identify(self, method: str, headers: Headers, peer: str, upload: bool = False) -> Identity:
        """`upload`: the route takes a multipart form."""
        if not self.keyed:
            declared = _declares_upload(headers) if upload else _declares(headers, b"application/json")
            if method == "POST" and _has_body(headers) and not declared:
                raise UnsupportedMediaType(
                    "Send the upload as multipart/form-data, with an 'Authorization' header." if upload
                    else "Send the request body as JSON, with 'Content-Type: application/json'."
                )
            return NOBODY
        presented = presented_keys(headers)
        if not presented:
            raise AuthenticationFailed(
                "You didn't provide an API key. Send it as 'Authorization: Bearer YOUR_KEY' (or 'x-api-key: YOUR_KEY')."
            )
        if len(presented) > 1:  # which one counts is for no layer to guess
            self._failed(peer, headers)
            raise AuthenticationFailed("This request presents more than one API key; send exactly one.")
        identity = self._lookup(presented.pop())
        if identity is None:
            self._failed(peer, headers)
            raise AuthenticationFailed("Incorrect API key provided.")
        return identity

    def reidentify(self, stored: Identity) -> Identity | None:
        """Who an identity kept on disk (a batch's creator) is now, looked up by tenant (stable where the id is not);
        None when no key answers to it any longer."""
        if not self.keyed:
            return NOBODY if stored == NOBODY else None
        if stored.tenant == _file_tenant(stored.key_id):
            return stored if self.tenants and self.tenants.known(stored.key_id) else None
        return self.keys.by_tenant.get(stored.tenant)

    def _failed(self, peer: str, headers: Headers) -> None:
        address = self.proxies.client(peer, headers)
        wait = self.throttle.wait_s(address)
        if wait > 0:
            metrics.labelled(metrics.RATE_LIMITED, "auth_failures").inc()
            raise RateLimited(
                "Too many failed API key attempts from this address; please try again later.",
                headers={"Retry-After": str(max(1, round(wait)))},
            )
        self.throttle.failed(address)

    def _lookup(self, presented: str) -> Identity | None:
        if not presented:
            return None
        file_id = self.tenants.identify(presented) if self.tenants else None
        if file_id is not None:
            return Identity(file_id, _file_tenant(file_id))
        return self.keys.identify(presented)


def _file_tenant(key_id: str) -> str:
    """A keys-file key's tenant: its id there, in a namespace no settings key's tenant (a hex digest) is in."""
    return f"keys-file:{key_id}"


def authenticator_of(settings: Settings, tenants: Tenants) -> Authenticator:
    """One per process, shared by the auth layer and the batch runner, so both name a key by the same id."""
    return Authenticator(
        KeyRing(settings.api_keys, settings.key_id_secret), AttemptThrottle(settings.auth_failures_per_minute), tenants,
        TrustedProxies(settings.forwarded_allow_ips, settings.forwarded_header),
    )
