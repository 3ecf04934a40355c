"""The MCP servers file (YAML, docs/mcp.md): the servers the gateway reaches under labels of its own, each with the
gateway's own credentials for it, and the one canonical form of an MCP server's URL that every comparison uses."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated
from urllib.parse import urlsplit, urlunsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, StringConstraints, field_validator

from gateway.settings import McpSettings, read_yaml

# no "__" in a label: the /mcp gateway names a tool `<label>__<tool>` and splits at the first "__"
LABEL = r"^[A-Za-z0-9-]+(_[A-Za-z0-9-]+)*$"
Label = Annotated[str, StringConstraints(pattern=LABEL, max_length=64)]
SEPARATOR = "__"
_DEFAULT_PORTS = {"http": 80, "https": 443}
_ENV = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


class ServersFileError(ValueError): ...


def canonical_url(url: str) -> str:
    """`url` as every comparison sees it: http or https, the host lower-case without a trailing dot (IDNA for a
    non-ASCII name), no default port, no fragment; ValueError (a message safe to show) for anything else, and for
    credentials in the URL (they belong in headers, which are never logged)."""
    if len(url) > 2048 or any(ord(c) <= 0x20 or c == "\x7f" for c in url):
        raise ValueError("must be an http:// or https:// URL of at most 2048 characters, without spaces")
    parts = urlsplit(url)
    scheme = parts.scheme.lower()
    if scheme not in _DEFAULT_PORTS or not parts.netloc:
        raise ValueError("must be an http:// or https:// URL")
    if "@" in parts.netloc:
        raise ValueError("must not carry credentials: send them as headers")
    try:
        port = parts.port
        host = (parts.hostname or "").rstrip(".").encode("idna").decode("ascii").lower()
    except (ValueError, UnicodeError) as exc:
        raise ValueError("has an invalid host or port") from exc
    if not host:
        raise ValueError("has no host")
    netloc = f"[{host}]" if ":" in host else host
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        netloc = f"{netloc}:{port}"
    return urlunsplit((scheme, netloc, parts.path or "/", parts.query, ""))


class ServerSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")

    url: str
    headers: dict[str, SecretStr] = Field(default_factory=dict)  # the gateway's own credentials for this server
    allow_private: bool = False  # its address may be a loopback, link-local or private one (a server in the cluster)
    timeout_s: float | None = Field(None, gt=0)

    @field_validator("url")
    @classmethod
    def _canonical(cls, value: str) -> str:
        return canonical_url(value)


class ServersFile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    servers: dict[Label, ServerSpec] = Field(default_factory=dict)


@dataclass(frozen=True)
class McpServer:
    label: str
    url: str  # canonical
    headers: Mapping[str, str] = field(repr=False)  # never logged, never shown
    allow_private: bool
    timeout_s: float


class McpServers:
    """The servers file, read once at start (`settings.mcp.servers_file`), with the bounds of a call to any server."""

    def __init__(self, settings: McpSettings) -> None:
        self.timeout_s, self.max_output_bytes = settings.timeout_s, settings.max_output_bytes
        file = read(settings.servers_file) if settings.servers_file is not None else ServersFile()
        self.by_label = {label: McpServer(label, spec.url, _expanded(label, spec.headers), spec.allow_private,
                                          spec.timeout_s or settings.timeout_s)
                         for label, spec in file.servers.items()}
        self.by_url = {server.url: server for server in self.by_label.values()}
        if len(self.by_url) < len(self.by_label):
            raise ServersFileError("MCP servers file: two labels name the same url")


def read(path: Path) -> ServersFile:
    return read_yaml(path, ServersFile, ServersFileError, "MCP servers file")


def _expanded(label: str, headers: Mapping[str, SecretStr]) -> dict[str, str]:
    """Header values with `${NAME}` read from the environment, so that a token need not be written in the file."""

    def value(match: re.Match[str]) -> str:
        found = os.environ.get(match.group(1))
        if found is None:
            raise ServersFileError(f"MCP servers file: server '{label}': no environment variable {match.group(1)}")
        return found

    return {name: _ENV.sub(value, secret.get_secret_value()) for name, secret in headers.items()}
