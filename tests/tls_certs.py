"""Certificates for the TLS tests (trustme) and the client side of a handshake: the server's files
on disk (rotated as a Secret volume update does), client contexts trusting one CA or another, and
one raw handshake that tells the certificate served and the TLS version."""

from __future__ import annotations

import os
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme

HOST = "127.0.0.1"
TIMEOUT_S = 30


@dataclass
class Files:
    """A server certificate (for 127.0.0.1) and its key on disk, issued by `ca`."""

    folder: Path
    ca: trustme.CA

    def __post_init__(self) -> None:
        self.folder.mkdir(parents=True, exist_ok=True)
        self.issue(self.ca)

    @property
    def cert(self) -> Path:
        return self.folder / "tls.crt"

    @property
    def key(self) -> Path:
        return self.folder / "tls.key"

    def issue(self, ca: trustme.CA) -> bytes:
        """A new certificate by `ca`, written as a Secret volume update does (replace, not rewrite);
        returns it (DER)."""
        leaf = ca.issue_cert(HOST)
        self.replace(self.key, leaf.private_key_pem.bytes())
        self.replace(self.cert, leaf.cert_chain_pems[0].bytes())
        return ssl.PEM_cert_to_DER_cert(leaf.cert_chain_pems[0].bytes().decode())

    @staticmethod
    def replace(path: Path, data: bytes) -> None:
        scratch = path.with_suffix(".new")
        scratch.write_bytes(data)
        os.replace(scratch, path)


def client_context(ca: trustme.CA, cert: trustme.LeafCert | None = None,
                   max_version: ssl.TLSVersion | None = None) -> ssl.SSLContext:
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    ca.configure_trust(context)
    if cert is not None:
        cert.configure_cert(context)
    if max_version is not None:
        context.maximum_version = max_version
    return context


def handshake(base: str, context: ssl.SSLContext) -> tuple[bytes, str | None]:
    """One fresh connection: the certificate the server presents (DER) and the TLS version."""
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection((HOST, port), timeout=TIMEOUT_S) as raw:
        with context.wrap_socket(raw, server_hostname=HOST) as tls:
            certificate = tls.getpeercert(binary_form=True)
            assert certificate is not None
            return certificate, tls.version()


def served_certificate(base: str, context: ssl.SSLContext) -> bytes | None:
    try:
        return handshake(base, context)[0]
    except ssl.SSLError:
        return None
