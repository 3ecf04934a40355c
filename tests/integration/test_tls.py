"""HTTPS on the real engine: a gateway of its own (`python -m gateway serve`) with a certificate made
here (trustme), client certificates required (mTLS) and TLS 1.3 at least. The openai SDK talks to
it over https; plain HTTP, a client without a certificate, a client that trusts another CA and a
TLS 1.2 client are refused; a SIGHUP after a rotation serves the new certificate to new connections.
(The unit tests, tests/unit/test_tls.py, cover the same on the fake engine in more cases.)"""

from __future__ import annotations

import json
import os
import signal
import ssl
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import pytest
import trustme

from tests.integration.conftest import MODEL, gateway_process, in_front_of
from tests.tls_support import Files, client_context, handshake, served_certificate
from tests.waits import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("TLS settings are the gateway's own")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@dataclass
class Secure:
    base: str
    process: subprocess.Popen
    log: Path
    files: Files
    server_ca: trustme.CA
    clients: trustme.CA  # the CA the gateway verifies client certificates against
    client: trustme.LeafCert  # a client certificate it issued

    def context(self, **kwargs) -> ssl.SSLContext:
        return client_context(self.server_ca, self.client, **kwargs)


@pytest.fixture(scope="module")
def secure(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Secure]:
    folder = tmp_path_factory.mktemp("tls")
    server_ca, clients = trustme.CA(), trustme.CA()
    files = Files(folder / "certs", server_ca)
    clients.cert_pem.write_to_path(str(folder / "certs" / "clients-ca.pem"))
    client = clients.issue_cert("service-a@example.com")
    env = {
        "GATEWAY_TLS__CERT_FILE": str(files.cert), "GATEWAY_TLS__KEY_FILE": str(files.key),
        "GATEWAY_TLS__CA_FILE": str(folder / "certs" / "clients-ca.pem"),
        "GATEWAY_TLS__CLIENT_AUTH": "required", "GATEWAY_TLS__MIN_VERSION": "TLSv1.3",
        "GATEWAY_TLS__RELOAD_INTERVAL_S": "0",  # SIGHUP only: the reload test shows that it works
        **in_front_of(server, folder), "GATEWAY_WARMUP": "false", "GATEWAY_CACHE__BACKEND": "off",
        "GATEWAY_LOG_FORMAT": "json",
    }
    with gateway_process(folder, env, tls=client_context(server_ca, client)) as (base, process):
        yield Secure(base, process, folder / "gateway.log", files, server_ca, clients, client)


def sdk(secure: Secure, context: ssl.SSLContext) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{secure.base}/v1", api_key="unused", max_retries=0,
                         http_client=httpx.Client(verify=context, timeout=120))


def test_openai_sdk_over_https_with_a_client_certificate(secure: Secure) -> None:
    assert handshake(secure.base, secure.context())[1] == "TLSv1.3"
    with sdk(secure, secure.context()) as client:
        answer = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
        assert "Paris" in (answer.choices[0].message.content or "")
        stream = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16,
                                                stream=True)
        assert "Paris" in "".join(chunk.choices[0].delta.content or "" for chunk in stream if chunk.choices)


@pytest.mark.parametrize("client", ["no client certificate", "another CA's client certificate",
                                    "trusts another CA", "TLS 1.2 only"])
def test_refused_clients(secure: Secure, client: str) -> None:
    context = {
        "no client certificate": lambda: client_context(secure.server_ca),
        "another CA's client certificate": lambda: client_context(secure.server_ca,
                                                                  trustme.CA().issue_cert("intruder@example.com")),
        "trusts another CA": lambda: client_context(trustme.CA(), secure.client),
        "TLS 1.2 only": lambda: secure.context(max_version=ssl.TLSVersion.TLSv1_2),
    }[client]()
    with sdk(secure, context) as refused, pytest.raises(openai.APIConnectionError):
        refused.models.list()
    with sdk(secure, secure.context()) as welcome:
        assert [m.id for m in welcome.models.list().data] == [MODEL]


def test_plain_http_is_refused(secure: Secure) -> None:
    with pytest.raises(httpx.TransportError):
        httpx.get(secure.base.replace("https://", "http://") + "/health", timeout=30)


def test_sighup_serves_a_rotated_certificate(secure: Secure) -> None:
    """Last: it changes the server's certificate. Files replaced, nothing happens (no polling here);
    SIGHUP, and a new connection gets the new certificate, from a new CA the client now trusts."""
    before = handshake(secure.base, secure.context())[0]
    new_ca = trustme.CA()
    rotated = secure.files.issue(new_ca)
    new_client = client_context(new_ca, secure.client)
    assert served_certificate(secure.base, secure.context()) == before
    os.kill(secure.process.pid, signal.SIGHUP)
    until_sync(lambda: secure.process.poll() is not None or served_certificate(secure.base, new_client) == rotated,
               60, "the new certificate served", step_s=0.2)
    assert secure.process.poll() is None
    with sdk(secure, new_client) as client:
        answer = client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=0, max_tokens=16)
        assert "Paris" in (answer.choices[0].message.content or "")
    with sdk(secure, secure.context()) as old, pytest.raises(openai.APIConnectionError):
        old.models.list()
    events = [json.loads(line) for line in secure.log.read_text().splitlines() if line.startswith("{")]
    assert any(e.get("event") == "tls_reloaded" and e.get("reason") == "SIGHUP" for e in events)
    metrics = httpx.get(f"{secure.base}/metrics", verify=new_client).text
    assert 'gateway_tls_reloads_total{result="ok"} 1.0' in metrics
