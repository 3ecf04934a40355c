"""Who may reach which MCP server and call which of its tools: the one place the boundary is enforced, for the
Responses API's `mcp` tool and the /mcp gateway alike. A server comes from the servers file (by its label, or its
URL: then with the gateway's credentials for it) or is a URL the client names (then with the client's headers only,
and only if every address its host resolves to is a public one: the gateway is no way into the cluster's network).
The key's allow-list (the keys file's `mcp`) names servers by label or URL and may narrow each one's tools."""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from gateway.errors import InvalidRequest, PermissionDenied
from gateway.mcp.servers import McpServer, McpServers, canonical_url
from gateway.tenancy.tenants import KeyPolicy

IP = ipaddress.IPv4Address | ipaddress.IPv6Address
_NAT64 = ipaddress.ip_network("64:ff9b::/96")
# headers the transport sets itself: a client's would change where or how the request goes
_RESERVED = frozenset({"host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
                       "keep-alive", "proxy-authorization", "proxy-connection", "accept", "content-type",
                       "mcp-session-id", "mcp-protocol-version", "last-event-id"})


@dataclass(frozen=True)
class Target:
    """An MCP server this key may reach, and how. `label` is the name the key's allow-list knows it by (the servers
    file's label; for a URL the file does not name, that URL in its canonical form), which `tool_allowed` takes."""

    label: str
    url: str
    headers: Mapping[str, str] = field(repr=False)  # never in a log line, an error or a repr
    timeout_s: float = 30.0  # the server's own bound (the servers file's, else settings.mcp.timeout_s)
    max_output_bytes: int = 1024 * 1024
    address: str | None = None  # the checked address the connection goes to (None: a server allowed private ones)

    def __str__(self) -> str:
        return f"MCP server '{self.label}'"


async def reach(policy: KeyPolicy | None, *, servers: McpServers, server_label: str, server_url: str | None,
                headers: Mapping[str, str]) -> Target:
    """The server `server_url` (or without one, the servers file's `server_label`) for this key, or a refusal:
    PermissionDenied (403) outside the key's allow-list, InvalidRequest (400) for a bad URL, bad headers or a private
    address. `headers`: the client's own for the server (`headers` or `authorization` of the Responses tool)."""
    param = "server_label" if server_url is None else "server_url"
    server = _server(servers, server_label, server_url)
    url = server.url if server is not None else canonical(server_url or "")
    name = server.label if server is not None else url
    grant = None if policy is None else policy.mcp
    if grant is not None and name not in grant.servers:
        raise PermissionDenied(f"This API key may not use the MCP server '{server_label}'.", param=param)
    own = _client_headers(headers)
    if server is not None:  # the gateway's headers for its server, over the client's of the same names
        theirs = {name.lower() for name in server.headers}
        own = {name: value for name, value in own.items() if name.lower() not in theirs} | dict(server.headers)
    address = None
    if server is None or not server.allow_private:
        address = await _public_address(url, param, servers.timeout_s)
    return Target(name, url, own, server.timeout_s if server is not None else servers.timeout_s,
                  servers.max_output_bytes, address)


def tool_allowed(policy: KeyPolicy | None, label: str, tool: str) -> bool:
    """Whether the key may list and call `tool` of the server its allow-list knows as `label` (a `Target`'s)."""
    grant = None if policy is None else policy.mcp
    if grant is None:
        return True
    if label not in grant.servers:
        return False
    return next((tool in tools for server, tools in grant.tools if server == label), True)


def canonical(url: str) -> str:
    try:
        return canonical_url(url)
    except ValueError as exc:
        raise InvalidRequest(f"Invalid 'server_url': {exc}.", param="server_url") from exc


def _server(servers: McpServers, label: str, url: str | None) -> McpServer | None:
    if url is None:
        found = servers.by_label.get(label)
        if found is None:
            raise InvalidRequest(f"Give 'server_url': the gateway's servers file names no MCP server '{label}'.",
                                 param="server_url")
        return found
    return servers.by_url.get(canonical(url))


def _client_headers(headers: Mapping[str, str]) -> dict[str, str]:
    for name, value in headers.items():
        if not name or any(c in name for c in ":\r\n\0 ") or any(c in value for c in "\r\n\0") \
                or not name.isascii() or name.lower() in _RESERVED:
            raise InvalidRequest("Invalid 'headers': a header the gateway cannot send (a reserved name, or a line "
                                 "break in a name or value).", param="headers")
    return dict(headers)


async def _public_address(url: str, param: str, timeout_s: float) -> str:
    """The first address `url`'s host resolves to, when every one is public; the connection goes to that one, so that
    a second answer of the name's DNS cannot point it elsewhere (rebinding)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        async with asyncio.timeout(timeout_s):  # not wait_for: on Python 3.11 it can swallow the caller's cancel
            found = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (OSError, TimeoutError, UnicodeError) as exc:
        raise InvalidRequest(f"Invalid '{param}': the MCP server's host '{host}' could not be resolved.",
                             param=param) from exc
    addresses = [ipaddress.ip_address(str(info[4][0]).partition("%")[0]) for info in found]
    if not addresses or not all(public(address) for address in addresses):
        raise InvalidRequest(f"Invalid '{param}': the MCP server's address is not a public one (loopback, private, "
                             "link-local and other reserved addresses are reached only through the gateway's "
                             "servers file).", param=param)
    return str(addresses[0])


def public(address: IP) -> bool:
    """A globally routable unicast address, also the IPv4 one an IPv6 address carries (mapped, 6to4, Teredo, NAT64)."""
    if isinstance(address, ipaddress.IPv6Address):
        inner = address.ipv4_mapped or address.sixtofour or (address.teredo or (None, None))[1]
        if inner is None and address in _NAT64:
            inner = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if inner is not None and not public(inner):
            return False
    return address.is_global and not (address.is_multicast or address.is_private or address.is_reserved
                                      or address.is_loopback or address.is_link_local or address.is_unspecified)
