"""HTTPS on real handshakes: the app on the fake engine behind a real uvicorn server (DrainingServer,
in a thread) with the gateway's own SSLContext, certificates made here with trustme, and clients
(the openai SDK, httpx, raw ssl sockets) that trust one CA or another. Covers plain-HTTP and
wrong-CA clients, mTLS (required, optional), the minimum TLS version, and certificate reload
(files rotated, SIGHUP)."""

from __future__ import annotations

import asyncio
import os
import signal
import ssl
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest
import structlog
import trustme
import uvicorn
from cryptography.hazmat.primitives import serialization
from pydantic import ValidationError

from gateway.pipeline.lifecycle import Lifecycle
from gateway.server.cli import parser, settings_from
from gateway.server.http import DrainingServer
from gateway.server.tls import ServerTLS, TLSConfigError
from gateway.settings import TLSSettings
from gateway.telemetry.metrics import TLS_RELOADS
from tests.fakes import HELLO
from tests.tls_support import WAIT_S, Files, client_context, handshake, served_certificate, serving, wait_for


@pytest.fixture
def ca() -> trustme.CA:
    return trustme.CA()


@pytest.fixture
def files(tmp_path: Path, ca: trustme.CA) -> Files:
    return Files(tmp_path / "server", ca)


def sdk(base: str, context: ssl.SSLContext) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(verify=context, timeout=WAIT_S))


def chat(base: str, context: ssl.SSLContext) -> str | None:
    """One chat completion through the openai SDK over https (its connection closed after)."""
    with sdk(base, context) as client:
        answer = client.chat.completions.create(model="fake-model", messages=HELLO, max_tokens=3)
        return answer.choices[0].message.content


def refused(base: str, context: ssl.SSLContext) -> bool:
    """True when the server will not talk to this client (handshake or first read fails)."""
    try:
        chat(base, context)
    except openai.APIConnectionError:
        return True
    return False


# ---------------------------------------------------------------------------------------------
# HTTPS


def test_openai_sdk_over_https(files: Files, ca: trustme.CA) -> None:
    with structlog.testing.capture_logs() as captured, serving(TLSSettings(cert_file=files.cert, key_file=files.key)) as base:
        assert chat(base, client_context(ca)) == "the quick brown"
        ready = httpx.get(f"{base}/ready", verify=client_context(ca))
        assert ready.status_code == 200
        assert ready.url.scheme == "https"
    [listening] = [line for line in captured if line["event"] == "listening"]
    assert (listening["scheme"], listening["port"]) == ("https", ready.url.port)  # the line tests read the port from


def test_plain_http_and_a_wrong_ca_are_refused(files: Files, ca: trustme.CA) -> None:
    with serving(TLSSettings(cert_file=files.cert, key_file=files.key)) as base:
        plain = base.replace("https://", "http://")
        with pytest.raises(httpx.TransportError):
            httpx.get(f"{plain}/health", timeout=WAIT_S)
        stranger = trustme.CA()
        with pytest.raises(openai.APIConnectionError) as caught:
            chat(base, client_context(stranger))
        assert isinstance(caught.value.__cause__, httpx.ConnectError)
        assert "CERTIFICATE_VERIFY_FAILED" in str(caught.value.__cause__)
        assert chat(base, client_context(ca)), "the server still serves clients that trust it"


def test_minimum_version_tls13_refuses_a_tls12_client(files: Files, ca: trustme.CA) -> None:
    tls12_only = client_context(ca, max_version=ssl.TLSVersion.TLSv1_2)
    with serving(TLSSettings(cert_file=files.cert, key_file=files.key)) as base:
        assert handshake(base, tls12_only)[1] == "TLSv1.2"  # the default minimum lets it in
        assert chat(base, tls12_only)
    with serving(TLSSettings(cert_file=files.cert, key_file=files.key, min_version="TLSv1.3")) as base:
        assert refused(base, tls12_only)
        with pytest.raises(ssl.SSLError):
            handshake(base, tls12_only)
        assert handshake(base, client_context(ca))[1] == "TLSv1.3"
        assert chat(base, client_context(ca))


# ---------------------------------------------------------------------------------------------
# client certificates (mTLS)


def mtls(files: Files, clients: trustme.CA, client_auth: str) -> TLSSettings:
    ca_file = files.folder / "clients-ca.pem"
    clients.cert_pem.write_to_path(str(ca_file))
    return TLSSettings(cert_file=files.cert, key_file=files.key, ca_file=ca_file, client_auth=client_auth)


def test_mtls_required(files: Files, ca: trustme.CA) -> None:
    clients, strangers = trustme.CA(), trustme.CA()
    with serving(mtls(files, clients, "required")) as base:
        assert refused(base, client_context(ca))  # no client certificate
        assert refused(base, client_context(ca, strangers.issue_cert("intruder@example.com")))
        assert chat(base, client_context(ca, clients.issue_cert("service-a@example.com"))) == "the quick brown"


def test_mtls_optional(files: Files, ca: trustme.CA) -> None:
    clients, strangers = trustme.CA(), trustme.CA()
    with serving(mtls(files, clients, "optional")) as base:
        assert chat(base, client_context(ca))  # none sent: let in
        assert chat(base, client_context(ca, clients.issue_cert("service-a@example.com")))
        assert refused(base, client_context(ca, strangers.issue_cert("intruder@example.com")))  # sent, not valid


# ---------------------------------------------------------------------------------------------
# reload without a restart


def test_rotated_files_are_served_to_new_connections(files: Files, ca: trustme.CA) -> None:
    """A certificate by a new CA replaces the old one on disk; the server notices by itself, and a
    new connection gets it, while clients of the old CA are now refused."""
    old_ca_client = client_context(ca)
    with serving(TLSSettings(cert_file=files.cert, key_file=files.key, reload_interval_s=0.05)) as base:
        before, _ = handshake(base, old_ca_client)
        new_ca = trustme.CA()
        new_ca_client = client_context(new_ca)
        assert refused(base, new_ca_client)
        rotated = files.issue(new_ca)
        assert rotated != before
        wait_for(lambda: served_certificate(base, new_ca_client) == rotated)
        assert chat(base, new_ca_client) == "the quick brown"
        assert refused(base, old_ca_client)


def test_a_mismatched_pair_is_not_loaded(files: Files, ca: trustme.CA) -> None:
    """Half a rotation (a new certificate beside the old key) is refused and the old pair stays in
    service; once the key matches, the next poll loads them."""
    client = client_context(ca)
    tls = ServerTLS(TLSSettings(cert_file=files.cert, key_file=files.key, reload_interval_s=0.05))
    errors = TLS_RELOADS.labels(result="error")._value.get()
    with serving(tls) as base:
        before, _ = handshake(base, client)
        old_key = files.key.read_bytes()
        rotated = files.issue(ca)
        new_key = files.key.read_bytes()
        Files.replace(files.key, old_key)
        assert tls.reload("test") is False
        assert TLS_RELOADS.labels(result="error")._value.get() == errors + 1
        assert handshake(base, client)[0] == before
        assert chat(base, client)
        Files.replace(files.key, new_key)
        wait_for(lambda: served_certificate(base, client) == rotated)


class Recorder:
    def __init__(self) -> None:
        self.reasons: list[str] = []
        self.polls = 0

    def reload(self, reason: str) -> bool:
        self.reasons.append(reason)
        return True

    def poll(self) -> None:
        self.polls += 1


def test_sighup_reloads() -> None:
    """A real SIGHUP to this process, with the server's signal handlers in place (main thread)."""
    recorder = Recorder()
    server = DrainingServer(uvicorn.Config(app=None), Lifecycle(), drain_timeout_s=0, reloadables=[recorder])
    before = signal.getsignal(signal.SIGHUP)
    with server.capture_signals():
        assert signal.getsignal(signal.SIGHUP) == server.handle_hangup
        os.kill(os.getpid(), signal.SIGHUP)
        wait_for(lambda: server._reload_requested)
    assert signal.getsignal(signal.SIGHUP) == before
    asyncio.run(server.on_tick(1))
    assert recorder.reasons == ["SIGHUP"]
    assert recorder.polls == 1
    asyncio.run(server.on_tick(2))
    assert recorder.reasons == ["SIGHUP"]
    assert recorder.polls == 2
    assert not server.should_exit


def test_sighup_keeps_its_default_with_nothing_to_reload() -> None:
    server = DrainingServer(uvicorn.Config(app=None), Lifecycle(), drain_timeout_s=0)
    before = signal.getsignal(signal.SIGHUP)
    with server.capture_signals():
        assert signal.getsignal(signal.SIGHUP) == before


# ---------------------------------------------------------------------------------------------
# settings


def test_settings_from_environment_and_flags(monkeypatch: pytest.MonkeyPatch, files: Files) -> None:
    monkeypatch.setenv("GATEWAY_TLS__CERT_FILE", str(files.cert))
    monkeypatch.setenv("GATEWAY_TLS__KEY_FILE", str(files.key))
    monkeypatch.setenv("GATEWAY_TLS__MIN_VERSION", "TLSv1.3")
    settings = settings_from(parser().parse_args(["serve", "--tls-client-auth", "required", "--tls-ca-file", "/ca.pem"]))
    assert settings.tls == TLSSettings(cert_file=files.cert, key_file=files.key, min_version="TLSv1.3",
                                       client_auth="required", ca_file=Path("/ca.pem"))
    assert settings.tls.enabled
    assert not TLSSettings().enabled


@pytest.mark.parametrize(("values", "problem"), [
    ({"client_auth": "required", "cert_file": "c.pem"}, "needs tls.ca_file"),
    ({"key_file": "k.pem"}, "need tls.cert_file"),
    ({"min_version": "TLSv1.1", "cert_file": "c.pem"}, "TLSv1.2"),
])
def test_incomplete_settings_are_refused(values: dict[str, str], problem: str) -> None:
    with pytest.raises(ValidationError, match=problem):
        TLSSettings(**values)


def test_an_encrypted_key_with_its_password(files: Files, ca: trustme.CA) -> None:
    key = serialization.load_pem_private_key(files.key.read_bytes(), password=None)
    encrypted = key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                  serialization.BestAvailableEncryption(b"s3cret"))
    Files.replace(files.key, encrypted)
    for wrong in ("wrong", None):  # None: refused, not a prompt on the terminal
        with pytest.raises(TLSConfigError):
            ServerTLS(TLSSettings(cert_file=files.cert, key_file=files.key, key_password=wrong))
    with serving(TLSSettings(cert_file=files.cert, key_file=files.key, key_password="s3cret")) as base:
        assert chat(base, client_context(ca))


def test_unusable_files_are_refused_at_start(tmp_path: Path, files: Files) -> None:
    with pytest.raises(TLSConfigError, match="No such file"):
        ServerTLS(TLSSettings(cert_file=tmp_path / "missing.pem"))
    with pytest.raises(TLSConfigError):
        ServerTLS(TLSSettings(cert_file=files.cert, key_file=files.cert))  # a certificate is not a key
    # the command exits 2 before loading any engine
    env = {**os.environ, "GATEWAY_TLS__CERT_FILE": str(tmp_path / "missing.pem")}
    result = subprocess.run([sys.executable, "-m", "gateway", "serve"], capture_output=True, text=True, env=env,
                            timeout=60)
    assert result.returncode == 2
    assert "configuration error" in result.stderr
    assert "missing.pem" in result.stderr
