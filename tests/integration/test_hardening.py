"""Hardening on the real server and engine (the session gateway): what a careless or hostile client
sends gets a 4xx naming the problem, never a 5xx; token ids meet the real vocabulary; request ids,
exact paths, JSON-only POSTs, slow headers and abandoned uploads as `python -m gateway serve` has
them. The rest (admission by engine requests, tenants, upstream errors, logs) is in tests/unit,
and the reliability figures in RELIABILITY.md (`make chaos`)."""

from __future__ import annotations

import socket
import time
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import MODEL
from tests.waits import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("the gateway's own hardening")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
VOCAB = 49152  # SmolLM2's


def requests_with(base_url: str, status: str) -> float:
    families = text_string_to_metric_families(httpx.get(f"{base_url}/metrics").text)
    return sum(s.value for f in families if f.name == "gateway_requests" for s in f.samples
               if s.name == "gateway_requests_total" and s.labels["status"] == status)


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/chat/completions", {"logit_bias": {str(VOCAB): 5}}, "logit_bias"),
        ("/v1/chat/completions", {"stop_token_ids": [VOCAB]}, "stop_token_ids"),
        ("/v1/completions", {"prompt": [[1, 2], [VOCAB]]}, "prompt"),
        ("/v1/chat/completions", {"seed": 2**64}, "seed"),
        ("/v1/chat/completions", {"top_k": 2**70, "temperature": 0}, "top_k"),
        ("/v1/chat/completions", {"logit_bias": {"²": 1}}, "logit_bias"),
        ("/v1/chat/completions", {"logit_bias": {"1" * 5000: 1}}, "logit_bias"),
        ("/v1/chat/completions", {"n": 4, "max_tokens": 1, "min_tokens": 2}, "min_tokens"),
    ],
)
def test_out_of_range_numbers_and_token_ids_are_400(base_url: str, path: str, extra: dict, param: str) -> None:
    body = {"model": MODEL, "max_tokens": 2, **({"messages": QUESTION} if "chat" in path else {}), **extra}
    response = httpx.post(f"{base_url}{path}", json=body, timeout=60)
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"].startswith(param)


def test_the_last_token_id_of_the_vocabulary_is_fine(base_url: str) -> None:
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 2, "logit_bias": {str(VOCAB - 1): 1},
            "stop_token_ids": [VOCAB - 1]}
    assert httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=60).status_code == 200


def test_integers_past_64_bits_inside_tools_and_schemas_are_no_server_error(base_url: str) -> None:
    """vLLM's own server answers a 500 here (its engine's wire format stops at 64 bits)."""
    schema = {"type": "object", "properties": {"n": {"type": "integer", "maximum": 2**80}}, "required": ["n"]}
    tools = [{"type": "function", "function": {"name": "f", "parameters": schema}}]
    body = {"model": MODEL, "messages": QUESTION, "max_tokens": 8, "temperature": 0, "tools": tools}
    answers = [httpx.post(f"{base_url}/v1/chat/completions", json=body, timeout=120) for _ in range(2)]
    assert [a.status_code for a in answers] == [200, 200]  # offered to the prompt: any number is fine
    assert answers[1].headers["x-cache"] == "HIT"  # and the cache keys it despite the big number
    fmt = {"type": "json_schema", "json_schema": {"name": "big", "schema": schema}}
    constrained = httpx.post(f"{base_url}/v1/chat/completions", json={**body, "tools": None, "response_format": fmt})
    assert constrained.status_code == 400
    assert constrained.json()["error"]["param"] == "response_format.json_schema.schema"


def test_request_ids_and_exact_paths(base_url: str) -> None:
    assert httpx.get(f"{base_url}/health", headers={"X-Request-ID": "ok-123"}).headers["x-request-id"] == "ok-123"
    mangled = httpx.get(f"{base_url}/health", headers=[(b"X-Request-ID", "café".encode())])
    assert mangled.headers["x-request-id"] != "café"
    assert mangled.headers["x-request-id"].isalnum()
    redirect = httpx.get(f"{base_url}/health/", headers={"Host": "evil.example"}, follow_redirects=False)
    assert redirect.status_code == 404
    assert "location" not in redirect.headers
    assert redirect.headers["x-request-id"]


def test_without_keys_a_post_must_say_json(base_url: str) -> None:
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}' % MODEL.encode()
    refused = httpx.post(f"{base_url}/v1/chat/completions", content=body, headers={"Content-Type": "text/plain"})
    assert refused.status_code == 415
    assert refused.json()["error"]["code"] == "unsupported_media_type"


def test_slow_headers_are_cut_off(base_url: str) -> None:
    """The session gateway runs with GATEWAY_HEADER_TIMEOUT_S=3 (tests/integration/conftest.py)."""
    address = urlsplit(base_url)
    with socket.create_connection((address.hostname, address.port), timeout=60) as sock:
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        assert sock.recv(1024) == b""  # closed by the server, well before our 60 s


def test_an_abandoned_upload_is_a_499(base_url: str) -> None:
    before = requests_with(base_url, "499")
    address = urlsplit(base_url)
    with socket.create_connection((address.hostname, address.port), timeout=10) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 5000\r\n\r\n{\"model\": ")
        time.sleep(0.5)  # the behaviour: a client that stalls mid-upload, then leaves
    until_sync(lambda: requests_with(base_url, "499") != before, 20, "a 499 counted", step_s=0.2)
    assert requests_with(base_url, "499") == before + 1


def _raw(base_url: str, request: bytes) -> bytes:
    """One request's whole answer, read to the close the server makes after it."""
    address = urlsplit(base_url)
    with socket.create_connection((address.hostname, address.port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    return answer


@pytest.mark.parametrize(("request_bytes", "status"), [
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
     b"Transfer_Encoding: chunked\r\nContent-Length: 2\r\n\r\n{}", b"400"),
    (b"GET /v1%2Fmodels HTTP/1.1\r\nHost: x\r\n\r\n", b"404"),
    (b"GET /v1/./models HTTP/1.1\r\nHost: x\r\n\r\n", b"404"),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(150)) + b"\r\n", b"431"),
])
def test_the_http_edge_on_the_real_server(base_url: str, request_bytes: bytes, status: bytes) -> None:
    """As `python -m gateway serve` has it (tests/unit/test_server.py has the whole table)."""
    assert _raw(base_url, request_bytes).startswith(b"HTTP/1.1 " + status)


def test_a_stream_to_an_http_1_0_client_is_close_delimited_on_the_real_server(base_url: str) -> None:
    body = b'{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "stream": true}' % MODEL.encode()
    head, _, events = _raw(base_url, b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                           b"Content-Length: %d\r\n\r\n" % len(body) + body).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    assert events.rstrip().endswith(b"data: [DONE]")
