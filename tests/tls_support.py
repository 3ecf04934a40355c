"""For the TLS tests: certificates (trustme) and the server's files on disk (rotated as a Secret
volume update does), client contexts trusting one CA or another, one raw handshake that tells the
certificate served and the TLS version, and the app on the fake engine served over TLS by a real
uvicorn server (DrainingServer, in a thread)."""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import trustme

from gateway.app import create_app
from gateway.pipeline.lifecycle import Lifecycle
from gateway.server.http import DrainingServer, server_config
from gateway.server.tls import ServerTLS
from gateway.settings import TLSSettings
from tests.fakes import FakeEngine, fake_settings
from tests.served import running
from tests.waits import until_sync

HOST = "127.0.0.1"
WAIT_S = 30  # a bound on waiting for an event, not a measurement


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
    with socket.create_connection((HOST, port), timeout=WAIT_S) as raw, context.wrap_socket(
        raw, server_hostname=HOST
    ) as tls:
        certificate = tls.getpeercert(binary_form=True)
        assert certificate is not None
        return certificate, tls.version()


def served_certificate(base: str, context: ssl.SSLContext) -> bytes | None:
    try:
        return handshake(base, context)[0]
    except ssl.SSLError:
        return None


@contextlib.contextmanager
def serving(tls: TLSSettings | ServerTLS) -> Iterator[str]:
    """The app on the fake engine, served over TLS by DrainingServer on a free loopback port."""
    server_tls = tls if isinstance(tls, ServerTLS) else ServerTLS(tls)
    lifecycle = Lifecycle()
    engine = FakeEngine()
    settings = fake_settings()
    app = create_app(settings, engine_starter=lambda es: engine, lifecycle=lifecycle)
    config = server_config(app, settings, server_tls.uvicorn_options())  # as `gateway serve` builds it
    server = DrainingServer(config, lifecycle, drain_timeout_s=0, reloadables=[server_tls])
    with running(server) as port:
        yield f"https://{HOST}:{port}"


def wait_for(condition: Callable[[], bool]) -> None:
    until_sync(condition, WAIT_S)
