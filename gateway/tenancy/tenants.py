"""Tenants: the keys file (YAML, see docs/tenants-and-guards.md), reloaded in place, and the `KeyPolicy` each request
runs under."""

from __future__ import annotations

import hashlib
import hmac
import re
from collections.abc import Collection, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    StringConstraints,
    field_validator,
    model_validator,
)

from gateway.mcp.servers import LABEL, canonical_url
from gateway.settings import Priority, Reloadable, read_yaml
from gateway.telemetry.metrics import KEYS_RELOADS

KeyId = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,63}$")]
T = TypeVar("T")


class KeysFileError(ValueError): ...


class Budget(BaseModel):
    model_config = ConfigDict(extra="forbid")

    day: int | None = Field(None, gt=0, description="Tokens (prompt + completion) per UTC day")
    month: int | None = Field(None, gt=0, description="Tokens (prompt + completion) per UTC month")


class McpAccess(BaseModel):
    """Which MCP servers (labels of the servers file, or URLs) and which of their tools a key may use."""

    model_config = ConfigDict(extra="forbid")

    servers: list[Annotated[str, StringConstraints(min_length=1, max_length=2048)]]
    tools: dict[str, list[str]] = Field(default_factory=dict, description="By server (as `servers` names it): "
                                        "its only tools this key may call; a server not here: all its tools")

    @field_validator("servers", mode="after")
    @classmethod
    def _canonical_servers(cls, servers: list[str]) -> list[str]:
        return [_server_name(server) for server in servers]

    @field_validator("tools", mode="after")
    @classmethod
    def _canonical_tools(cls, tools: dict[str, list[str]]) -> dict[str, list[str]]:
        return {_server_name(server): names for server, names in tools.items()}

    @model_validator(mode="after")
    def _tools_of_named_servers(self) -> McpAccess:
        for server in self.tools:
            if server not in self.servers:
                raise ValueError(f"tools: '{server}' is not one of this key's servers")
        return self


class KeySpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    key: SecretStr | None = None
    key_sha256: Annotated[str, StringConstraints(pattern=r"^[0-9a-fA-F]{64}$")] | None = None
    models: list[str] | None = None
    rpm: int | None = Field(None, gt=0)
    tpm: int | None = Field(None, gt=0)
    budget: Budget = Field(default_factory=Budget)
    guards: str | None = None
    priority: Priority = "normal"
    request_priority: bool = False
    team: str | None = Field(None, max_length=64)
    owner: str | None = Field(None, max_length=200)  # for people: read by no code
    mcp: McpAccess | None = None

    @field_validator("key", "key_sha256", mode="before")
    @classmethod
    def _quoted(cls, value: object) -> object:
        if value is not None and not isinstance(value, str):
            raise ValueError("must be a string: quote it (YAML reads some keys and hex digests as numbers)")
        return value

    @model_validator(mode="after")
    def _one_key(self) -> KeySpec:
        if (self.key is None) == (self.key_sha256 is None):
            raise ValueError("give the key as exactly one of `key` or `key_sha256`")
        return self

    def digest(self) -> bytes:
        if self.key is not None:
            return hashlib.sha256(self.key.get_secret_value().encode()).digest()
        assert self.key_sha256 is not None
        return bytes.fromhex(self.key_sha256)


class KeysFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    keys: dict[KeyId, KeySpec] = Field(default_factory=dict)

    @model_validator(mode="after")
    def _distinct_keys(self) -> KeysFile:
        seen: dict[bytes, str] = {}
        for key_id, spec in self.keys.items():
            other = seen.setdefault(spec.digest(), key_id)
            if other != key_id:
                raise ValueError(f"keys '{other}' and '{key_id}' are the same key")
        return self


@dataclass(frozen=True, slots=True)
class McpGrant:
    """A key's MCP allow-list as the keys file says it; `gateway.mcp.access` is the one place that reads it."""

    servers: tuple[str, ...]  # labels of the servers file, or URLs
    tools: tuple[tuple[str, frozenset[str]], ...] = ()  # a server (as `servers` names it) and its only tools


@dataclass(frozen=True, slots=True)
class KeyPolicy:
    key_id: str
    rpm: int | None = None
    tpm: int | None = None
    budget_day: int | None = None
    budget_month: int | None = None
    models: tuple[str, ...] | None = None  # None: every model; what they grant: ModelRegistry.access
    guards: str | None = None
    priority: Priority = "normal"
    request_priority: bool = False  # a request may raise its priority above the class (tenancy.priority)
    team: str = ""
    mcp: McpGrant | None = None  # None: every server of the servers file and any public URL, all their tools


@dataclass(frozen=True, slots=True)
class _Table:
    digests: tuple[tuple[bytes, str], ...]
    policies: dict[str, KeyPolicy]


def find(stored: Iterable[tuple[bytes, T]], presented: str) -> T | None:
    """What the stored SHA-256 digest of `presented` names; every digest compared, so the time does not tell which."""
    digest = hashlib.sha256(presented.encode()).digest()
    found = None
    for candidate, value in stored:
        if hmac.compare_digest(candidate, digest):
            found = value
    return found


def read(path: Path) -> KeysFile:
    return read_yaml(path, KeysFile, KeysFileError, "keys file")


class Tenants(Reloadable):
    """The keys file's table, swapped whole on reload; `rpm`/`tpm` are the global limits for keys without their own."""

    what = "keys"

    def __init__(self, path: Path | None, rpm: int | None = None, tpm: int | None = None,
                 reload_interval_s: float = 10) -> None:
        super().__init__([path] if path is not None else [], reload_interval_s, KEYS_RELOADS)
        self.path, self.rpm, self.tpm = path, rpm, tpm
        self._known_models: Collection[str] | None = None
        self._profiles: Collection[str] | None = None
        self._mcp_servers: Mapping[str, str] | None = None
        self._table = self._build(read(path)) if path is not None else _Table((), {})

    @property
    def enabled(self) -> bool:
        """With a keys file every API route needs a key (even if the file lists none)."""
        return self.path is not None

    def check(self, known_models: Iterable[str], profiles: Collection[str],
              mcp_servers: Mapping[str, str] | None = None) -> None:
        """Refuse models, guard profiles and MCP servers (`mcp_servers`: the servers file's URL by label) that do not
        exist, and a servers file's server named by its URL (its label is the one name a tool list applies to);
        remembered for every reload."""
        self._known_models, self._profiles, self._mcp_servers = frozenset(known_models), profiles, mcp_servers
        self._validate(self._table)

    def identify(self, presented: str) -> str | None:
        return find(self._table.digests, presented)

    def policy(self, key_id: str) -> KeyPolicy:
        return self._table.policies.get(key_id) or KeyPolicy(key_id, rpm=self.rpm, tpm=self.tpm)

    def known(self, key_id: str) -> bool:
        return key_id in self._table.policies

    def guard_profile(self, key_id: str) -> str | None:
        return self.policy(key_id).guards

    @property
    def prioritized(self) -> bool:
        """Whether any key has a class other than normal or may choose its requests' priority: then the engine
        schedules by priority."""
        return any(p.priority != "normal" or p.request_priority for p in self._table.policies.values())

    def apply(self) -> dict[str, Any]:
        assert self.path is not None
        table = self._build(read(self.path))
        self._validate(table)
        self._table = table
        return {"keys": len(table.policies)}

    def _build(self, file: KeysFile) -> _Table:
        policies = {key_id: KeyPolicy(
            key_id, rpm=spec.rpm or self.rpm, tpm=spec.tpm or self.tpm, budget_day=spec.budget.day,
            budget_month=spec.budget.month, models=tuple(spec.models) if spec.models is not None else None,
            guards=spec.guards, priority=spec.priority, request_priority=spec.request_priority,
            team=spec.team or "", mcp=_grant(spec.mcp),
        ) for key_id, spec in file.keys.items()}
        return _Table(tuple((spec.digest(), key_id) for key_id, spec in file.keys.items()), policies)

    def _validate(self, table: _Table) -> None:
        for key_id, policy in table.policies.items():
            if self._profiles is not None and policy.guards is not None and policy.guards not in self._profiles:
                known = ", ".join(sorted(self._profiles)) or "none"
                raise KeysFileError(f"keys file: key '{key_id}': no guard profile '{policy.guards}' (profiles: {known})")
            for entry in policy.models or ():
                if self._known_models is not None and not _known(entry, self._known_models):
                    raise KeysFileError(f"keys file: key '{key_id}': no model '{entry}' is served here")
            if policy.mcp is not None and self._mcp_servers is not None:
                _check_servers(key_id, policy.mcp, self._mcp_servers)


def _check_servers(key_id: str, grant: McpGrant, servers: Mapping[str, str]) -> None:
    labels = {url: label for label, url in servers.items()}
    for entry in grant.servers:
        if "://" not in entry and entry not in servers:
            raise KeysFileError(f"keys file: key '{key_id}': no MCP server '{entry}' in the servers file")
        if entry in labels:
            raise KeysFileError(f"keys file: key '{key_id}': name the MCP server {entry} by its label "
                                f"'{labels[entry]}'")


def _server_name(entry: str) -> str:
    """A server as the allow-list names it: a label of the servers file, or a URL in its canonical form."""
    if "://" in entry:
        try:
            return canonical_url(entry)
        except ValueError as exc:
            raise ValueError(f"'{entry}': {exc}") from exc
    if not re.fullmatch(LABEL, entry):
        raise ValueError(f"'{entry}' is neither a label of the MCP servers file nor an http(s) URL")
    return entry


def _grant(access: McpAccess | None) -> McpGrant | None:
    if access is None:
        return None
    return McpGrant(tuple(access.servers), tuple((server, frozenset(tools)) for server, tools in access.tools.items()))


def _known(entry: str, known: Collection[str]) -> bool:
    family, sep, wanted = entry.partition("@")
    return entry in known or bool(sep and family in known and re.fullmatch(r"[0-9A-Za-z.+-]+", wanted))
