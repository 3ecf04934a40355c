"""The real HTTP server (gateway.server.http: uvicorn with our protocol and limits) on the fake engine,
over loopback sockets: slow headers and idle connections are closed, the connection cap holds,
errors keep the keep-alive connection, and an abandoned upload is a 499."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import structlog
import uvicorn
from uvicorn.server import ServerState

from gateway.app import create_app
from gateway.pipeline.lifecycle import Lifecycle
from gateway.server.cli import parser, settings_from
from gateway.server.http import MAX_HEADER_BYTES, DrainingServer, http_protocol, server_config
from gateway.telemetry import logs, metrics
from tests import sse, waits
from tests.fakes import FakeEngine, chat_body, fake_settings
from tests.ports import listening_line


def until(condition: Any, what: str, within_s: float = 60) -> None:
    """Wait for `condition()` (polled), at most `within_s`."""
    deadline = time.monotonic() + within_s
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


class Running:
    """The server on port 0 (any free port) in a thread; `port`: the one it got, once entered."""

    def __init__(self, engine: FakeEngine, **settings: Any) -> None:
        self.engine = engine
        self.port = 0  # known once started
        config = fake_settings(port=0, **settings)
        lifecycle = Lifecycle()
        app = create_app(config, engine_starter=lambda es: engine, lifecycle=lifecycle)
        self.server = DrainingServer(server_config(app, config), lifecycle, drain_timeout_s=0)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self) -> Running:
        self.thread.start()
        until(lambda: self.server.started, "the server never started", 30)
        [(_, self.port)] = self.server.addresses()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)

    def connect(self) -> socket.socket:
        return socket.create_connection(("127.0.0.1", self.port), timeout=10)


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def running(engine: FakeEngine) -> Iterator[Running]:
    with Running(engine, header_timeout_s=0.3) as server:
        yield server


def closed_by_server(sock: socket.socket) -> bool:
    """Whether the server closed the connection (within the socket's 10 s timeout)."""
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def read_to_close(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    answer = b""
    while chunk := sock.recv(65536):
        answer += chunk
    return answer


def test_port_0_listens_on_a_free_port_and_says_which(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> None:
    """`gateway serve --port 0`: the server binds any free port and logs `listening` with the port it
    got (what the integration tests read back instead of picking a port that could be taken)."""
    monkeypatch.delenv("GATEWAY_PORT", raising=False)
    assert settings_from(parser().parse_args(["serve", "--port", "0"])).port == 0
    with structlog.testing.capture_logs() as captured, Running(engine) as server:
        [bound] = [sock.getsockname()[1] for listener in server.server.servers for sock in listener.sockets]
        connection = http.client.HTTPConnection("127.0.0.1", bound, timeout=10)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200
        connection.close()
    assert bound != 0
    assert server.port == bound
    assert [line for line in captured if line["event"] == "listening"] == [
        {"event": "listening", "log_level": "info", "host": "127.0.0.1", "port": bound, "scheme": "http"}]


@pytest.mark.parametrize("fmt", ["json", "console"])
def test_the_listening_line_reads_back_in_either_log_format(fmt: str, capsys: pytest.CaptureFixture[str]) -> None:
    """The integration tests find the port in the gateway's log as `gateway.telemetry.logs` writes it."""
    logs.configure("info", fmt)
    structlog.get_logger(f"test-{fmt}").info("listening", host="127.0.0.1", port=43210, scheme="https")
    assert listening_line(capsys.readouterr().err) == ("https", 43210)
    assert listening_line('{"event": "sampling_defaults", "port": 1}\nlistening port=2 scheme=http\n') is None


def test_headers_that_never_end_are_cut_off(engine: FakeEngine) -> None:
    # the idle bound the shortest there is: a connection with no byte yet is closed as an idle one
    with Running(engine, header_timeout_s=0.3, keep_alive_timeout_s=1) as running:
        with running.connect() as slow:
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # and never the blank line
            assert closed_by_server(slow)
        with running.connect() as idle:  # a connection that never sends a request
            assert closed_by_server(idle)


def test_headers_past_the_size_bound_are_cut_off() -> None:
    with Running(FakeEngine(), header_timeout_s=30) as server, server.connect() as big:
        big.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(MAX_HEADER_BYTES // 1000 + 10):
                big.sendall(b"X-Filler: " + b"a" * 1000 + b"\r\n")
        except OSError:
            pass  # closed while we were still sending
        assert closed_by_server(big)


def test_the_header_timeout_spares_a_connection_between_requests(running: Running) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=10)
    connection.request("GET", "/health")
    assert connection.getresponse().read() == b'{"status":"ok"}'
    first = connection.sock
    time.sleep(0.5)  # idle past the header timeout (0.3 s), within keep-alive: the timer runs only for headers
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
    assert connection.sock is first


def test_whole_headers_in_one_read_make_no_timer(monkeypatch: pytest.MonkeyPatch) -> None:
    """The header timer is made once per connection (for its first request) and again only when a
    request's headers come in pieces, not for every request on a keep-alive connection."""
    from gateway.server.http import HeaderTimeout

    armed: list[int] = []
    arm = HeaderTimeout._arm

    def counting(self: HeaderTimeout, timeout_s: float) -> None:
        armed.append(1)
        arm(self, timeout_s)

    monkeypatch.setattr(HeaderTimeout, "_arm", counting)
    with Running(FakeEngine(), header_timeout_s=5) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        for _ in range(5):
            connection.request("GET", "/health")
            assert connection.getresponse().read() == b'{"status":"ok"}'
        assert len(armed) == 1  # connection_made's
        with server.connect() as slow:  # headers in two reads: the timer runs between them
            slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
            until(lambda: len(armed) == 3, "the first piece's timer was never set")  # read apart from the rest
            slow.sendall(b"\r\n")
            assert slow.recv(1024).startswith(b"HTTP/1.1 200")
        assert len(armed) == 3  # the second connection's, and its first read's


def test_a_stream_whose_client_reads_nothing_is_dropped_and_aborted() -> None:
    """Over a real socket: the client asks for a long stream and never reads; once the socket and
    uvicorn's buffer are full, the send waits; after stream_write_timeout_s the connection is
    dropped and, after the grace a resumable stream gives its client, the engine request aborted; the server
    goes on serving."""
    engine = FakeEngine(max_model_len=1 << 20)
    with Running(engine, stream_write_timeout_s=1, header_timeout_s=30, streams={"grace_s": 0.5}) as server:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect(("127.0.0.1", server.port))
        body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 200_000, "stream": True}).encode()
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        until(lambda: engine.aborted, "the stalled stream was never aborted", 60)
        assert not engine.running
        sock.settimeout(10)
        try:  # dropped: what the kernel held is delivered, then the end (or a reset)
            while sock.recv(65536):
                pass
        except ConnectionResetError:
            pass
        sock.close()
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 200


def test_an_expect_100_continue_request_answered_before_its_body_closes_the_connection() -> None:
    """Refused (401) before its body was asked for: `connection: close`, then closed, so the
    client's next request cannot be read as the body it never sent. Read normally, it stays."""
    with Running(FakeEngine(), api_keys=["sk-test"], header_timeout_s=30) as server, server.connect() as sock:
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 40\r\nExpect: 100-continue\r\n\r\n")
        answer = read_to_close(sock)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401")
        assert b"connection: close" in head.lower()
        assert json.loads(body)["error"]["code"] == "invalid_api_key"
    with Running(FakeEngine(), api_keys=["sk-test"], header_timeout_s=30) as server:
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        body = json.dumps({"model": "fake-model", "prompt": "hi", "max_tokens": 2})
        for _ in range(2):  # read as usual: the connection is kept
            connection.request("POST", "/v1/completions", body, {"Content-Type": "application/json",
                                                                 "Authorization": "Bearer sk-test", "Expect": "100-continue"})
            response = connection.getresponse()
            assert response.status == 200
            assert response.getheader("connection") != "close"
            response.read()


def test_a_500_keeps_the_connection_and_says_its_request_id(running: Running, engine: FakeEngine) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=10)
    engine.fail_after = 0
    body = chat_body()
    headers = {"Content-Type": "application/json", "X-Request-ID": "broken-1"}
    # captured, not rendered: a traceback with its locals, rendered, took longer than the client's timeout
    with structlog.testing.capture_logs() as captured:
        connection.request("POST", "/v1/chat/completions", body=json.dumps(body), headers=headers)
        failed = connection.getresponse()
    assert [line["error_type"] for line in captured if line["event"] == "request_failed"] == ["RuntimeError"]
    assert failed.status == 500
    assert failed.getheader("x-request-id") == "broken-1"
    assert b"internal_error" in failed.read()
    assert failed.getheader("connection") != "close"
    sock = connection.sock
    engine.fail_after = None
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200
    assert connection.sock is sock


def test_an_abandoned_upload_is_counted_as_499(running: Running, engine: FakeEngine) -> None:
    before = metrics.REQUESTS.labels("", "/v1/chat/completions", "499")._value.get()
    with running.connect() as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 1000\r\n\r\n{\"model\": ")
        until(lambda: running.server.lifecycle.active == 1, "the upload never began")  # then abandoned
    until(lambda: metrics.REQUESTS.labels("", "/v1/chat/completions", "499")._value.get() != before,
          "the abandoned upload was never logged")
    assert engine.requests == []


def test_connections_past_the_cap_get_503() -> None:
    with Running(FakeEngine(), max_connections=2, header_timeout_s=30) as server:
        held = [server.connect() for _ in range(2)]
        until(lambda: len(server.server.server_state.connections) == 2, "the held connections were never accepted")
        connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
        connection.request("GET", "/health")
        assert connection.getresponse().status == 503
        for sock in held:
            sock.close()


@pytest.mark.parametrize(("trusted", "expected"), [("127.0.0.1", [401, 429, 401, 200]), ("", [401, 429, 429, 200])])
def test_the_auth_throttle_counts_the_client_behind_a_trusted_proxy(trusted: str, expected: list[int]) -> None:
    """From a trusted proxy (here loopback), X-Forwarded-For names the client: one client's
    failed attempts do not lock out every other client behind the same balancer; from a peer not
    trusted, the header is the client's own word and is ignored. A valid key always passes."""
    settings = {"api_keys": ["sk-right"], "auth_failures_per_minute": 1, "forwarded_allow_ips": trusted}
    with Running(FakeEngine(), **settings) as server:
        def attempt(client: str, key: str = "sk-guess") -> int:
            connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=10)
            headers = {"Authorization": f"Bearer {key}", "X-Forwarded-For": client}
            connection.request("GET", "/v1/models", headers=headers)
            return connection.getresponse().status

        assert [attempt("10.0.0.1"), attempt("10.0.0.1"), attempt("10.0.0.2"), attempt("10.0.0.1", "sk-right")] == expected


def test_an_error_before_the_router_has_its_length_for_an_http_1_0_client() -> None:
    """The middleware's errors (here auth's 401) go out with a Content-Length: without one uvicorn
    sends them chunked, which an HTTP/1.0 client takes for the body itself."""
    with Running(FakeEngine(), api_keys=["sk-right"]) as server, server.connect() as sock:
        sock.sendall(b"GET /v1/models HTTP/1.0\r\n\r\n")
        answer = read_to_close(sock)
        head, _, body = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 401")
        assert b"transfer-encoding" not in head.lower()
        assert json.loads(body)["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(("request_bytes", "dialect"), [
    (b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\nContent-Length: 5\r\n\r\n{}", "openai"),
    (b"POST /v1/messages HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n", "anthropic"),
    (b"FOO /health HTTP/1.1\r\nHost: x\r\n\r\n", "openai"),
])
def test_a_request_that_is_not_http_gets_a_400_in_the_api_shape(running: Running, request_bytes: bytes, dialect: str) -> None:
    """What uvicorn's parser refuses (conflicting lengths, a bad chunk size, an unknown method) is
    answered in the API's error shape, not uvicorn's plain text, and the connection closed."""
    with running.connect() as sock:
        sock.sendall(request_bytes)
        answer = read_to_close(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 400")
    assert b"content-type: application/json" in head
    error = json.loads(body)
    assert error["type"] == "error" if dialect == "anthropic" else error["error"]["type"] == "invalid_request_error"
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=10)
    connection.request("GET", "/health")
    assert connection.getresponse().status == 200  # still serving


def test_headers_sent_during_an_answer_are_bounded_too() -> None:
    """A client that streams a next request's headers, never ending them, while its request is
    answered (here a slow stream) is cut off past MAX_HEADER_BYTES: uvicorn would hold them all."""
    # no grace for a reconnect: the stream cut off ends with its connection, not at the server's shutdown
    with Running(FakeEngine(max_model_len=4096, delay=0.05), header_timeout_s=30, streams={"grace_s": 0}) as server, \
            server.connect() as sock:
        body = json.dumps(chat_body(max_tokens=2000, stream=True)).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")  # the stream is under way
        sock.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")
        try:
            for _ in range(4 * MAX_HEADER_BYTES // 1000):
                sock.sendall(b"X-Filler: " + b"a" * 1000 + b"\r\n")
        except OSError:
            pass  # closed while we were still sending
        deadline = time.monotonic() + 10
        while True:  # the stream's events until the server closes (before the stream's 100 s)
            try:
                if sock.recv(65536) == b"":
                    break
            except ConnectionResetError:
                break
            assert time.monotonic() < deadline, "the connection was not closed"


def test_endless_trailers_of_a_chunked_body_are_cut_off(running: Running) -> None:
    """After a chunked body's last chunk come its trailers, headers that uvicorn keeps: a client
    that never ends them is cut off past MAX_HEADER_BYTES, as for the request's own headers."""
    body = json.dumps(chat_body()).encode()
    with running.connect() as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n%x\r\n%b\r\n0\r\n" % (len(body), body))
        try:
            for _ in range(4 * MAX_HEADER_BYTES // 1000):
                sock.sendall(b"X-Trailer: " + b"a" * 1000 + b"\r\n")
        except OSError:
            pass  # closed while we were still sending
        assert closed_by_server(sock)


def test_a_body_in_small_chunks_is_not_taken_for_headers(running: Running) -> None:
    body = json.dumps(chat_body()).encode() + b" " * (2 * MAX_HEADER_BYTES)
    framed = b"".join(b"1;ext=%b\r\n%b\r\n" % (b"x" * 20, body[i:i + 1]) for i in range(len(body))) + b"0\r\n\r\n"
    with running.connect() as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Transfer-Encoding: chunked\r\n\r\n")
        for i in range(0, len(framed), 4096):
            sock.sendall(framed[i:i + 4096])
        assert sock.recv(65536).startswith(b"HTTP/1.1 200")



class _Transport(asyncio.Transport):
    """A transport that keeps what is written to it: a protocol driven read by read, without sockets."""

    def __init__(self) -> None:
        super().__init__()
        self.written = b""
        self.closed = False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return ("127.0.0.1", 8000) if name in ("sockname", "peername") else default

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.written += bytes(data)

    def close(self) -> None:
        self.closed = True

    def is_closing(self) -> bool:
        return self.closed

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def test_a_body_that_ends_in_one_large_read_is_not_taken_for_headers() -> None:
    """The read that completes a request's body (here all of it, past MAX_HEADER_BYTES) is body,
    not the next request's headers, though the body is complete after it."""
    received: list[bytes] = []

    async def app(scope: Any, receive: Any, send: Any) -> None:
        message = await receive()
        received.append(message["body"])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"0")]})
        await send({"type": "http.response.body", "body": b""})

    async def main() -> _Transport:
        protocol = http_protocol(10)(config=uvicorn.Config(app), server_state=ServerState(), app_state={})  # type: ignore[call-arg]
        transport = _Transport()
        protocol.connection_made(transport)
        body = b"x" * (2 * MAX_HEADER_BYTES)
        protocol.data_received(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        protocol.data_received(body)
        async with asyncio.timeout(10):
            while not transport.written:  # noqa: ASYNC110 - the answer, written by the app's task
                await asyncio.sleep(0.001)
        assert not transport.closed  # answered, and kept for the next request
        protocol.connection_lost(None)
        return transport

    transport = asyncio.run(main())
    assert received == [b"x" * (2 * MAX_HEADER_BYTES)]
    assert transport.written.startswith(b"HTTP/1.1 200")


def test_bad_bytes_after_a_request_let_its_answer_end_first(engine: FakeEngine) -> None:
    """Bytes that are not HTTP, pipelined after a good request (here while its stream is under way):
    its answer ends whole, then the connection closes; no 400 lands inside that answer."""
    engine.delay = 0.01
    with Running(engine) as server, server.connect() as sock:
        body = json.dumps(chat_body(max_tokens=20, stream=True)).encode()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n%b" % (len(body), body))
        answer = sock.recv(65536)
        sock.sendall(b"GARBAGE\r\n\r\n")
        while chunk := sock.recv(65536):
            answer += chunk
        assert answer.startswith(b"HTTP/1.1 200")
        assert answer.endswith(b"data: [DONE]\n\n\r\n0\r\n\r\n")
        assert b"HTTP/1.1 400" not in answer


CHAT = json.dumps(chat_body(max_tokens=3)).encode()


def _post(extra: bytes, path: bytes = b"/v1/chat/completions", body: bytes = CHAT) -> bytes:
    return (b"POST " + path + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n" + extra
            + b"Content-Length: %d\r\n\r\n" % len(body) + body)


@pytest.mark.parametrize(("request_bytes", "status"), [
    (_post(b"Transfer_Encoding: chunked\r\n"), 400),
    (_post(b"Content_Length: 5\r\n"), 400),
    (_post(b"X_Forwarded_For: 10.0.0.1\r\n"), 400),
    (_post(b"x_api_key: sk-other\r\n"), 400),
    (_post(b"X-Forwarded_For: 10.0.0.1\r\n"), 400),  # `_` for one `-` of two
    (_post(b"X-Api_Key: sk-other\r\n"), 400),
    (_post(b"Content-Length: 3\r\nTransfer-Encoding: chunked\r\n"), 400),  # with the Content-Length below
    (_post(b"Content-Length: %d\r\n" % len(CHAT)), 400),  # the same length twice
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-A: a\r\n folded\r\n\r\n", 400),
    (b"GET /health HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-H%d: v\r\n" % i for i in range(120)) + b"\r\n", 431),
    (b"GET /health HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * 40_000 + b"\r\n\r\n", 431),
    (b"GET /v1%2Fmodels HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1%2fmodels HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1%5Cmodels HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1/../v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1/./models HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1/%2e%2e/v1/models HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1/%2E/models HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1%2Fmodels/org%2Fm HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1/models/../models/x HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    # in a model id an encoded slash is the id's, but a dot segment between encoded slashes (or
    # backslashes) is one to a proxy that decodes them: `/health`, not the model `../../health`
    (b"GET /v1/models/..%2F..%2Fhealth HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1/models/org%2f.. HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1/models/org%5C%2e%2e%5Cx HTTP/1.1\r\nHost: x\r\n\r\n", 404),
    (b"GET /v1/models/org\\..\\x HTTP/1.1\r\nHost: x\r\n\r\n", 404),
])
def test_the_edge_refuses_what_a_proxy_could_read_another_way(running: Running, request_bytes: bytes, status: int) -> None:
    """As nginx and Envoy hold it: framing and identity headers spelt with `_`, conflicting or
    folded framing, too many or too large headers, encoded slashes and dot segments never reach a
    route; each refusal in the API's error shape, the connection closed, the server serving on."""
    with running.connect() as sock:
        sock.sendall(request_bytes)
        answer = read_to_close(sock)
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 %d" % status), head
    assert json.loads(body)["error"]["type"] == "invalid_request_error"
    assert status != 404 or json.loads(body)["error"]["code"] == "not_found"  # the edge's, not a route's model_not_found
    assert running.engine.requests == []
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=10)
    connection.request("GET", "/v1/models")
    assert connection.getresponse().status == 200


def test_an_encoded_slash_in_a_model_id_is_the_id_s(running: Running) -> None:
    """`/v1/models/{model:path}`: the SDKs send `org/model` as `org%2Fmodel`; it names that model."""
    connection = http.client.HTTPConnection("127.0.0.1", running.port, timeout=10)
    connection.request("GET", "/v1/models/org%2Fghost")
    answer = connection.getresponse()
    assert answer.status == 404
    assert json.loads(answer.read())["error"]["code"] == "model_not_found"  # the route's answer, not the edge's


def test_headers_within_the_bounds_and_plain_paths_are_served(running: Running) -> None:
    with running.connect() as sock:
        extra = b"".join(b"X-H%d: v\r\n" % i for i in range(90)) + b"X_Custom_Trace: fine\r\n"
        sock.sendall(_post(extra)[:-len(CHAT)].replace(b"HTTP/1.1\r\n", b"HTTP/1.1\r\nConnection: close\r\n") + CHAT)
        answer = read_to_close(sock)
    assert answer.startswith(b"HTTP/1.1 200"), answer[:200]


def test_a_stream_to_an_http_1_0_client_is_close_delimited(running: Running) -> None:
    """HTTP/1.0 has no chunked encoding: the stream's bytes are the body, up to the close."""
    body = json.dumps(chat_body(max_tokens=3, stream=True)).encode()
    with running.connect() as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\n"
                     b"Content-Length: %d\r\n\r\n" % len(body) + body)
        answer = read_to_close(sock)
    head, _, events = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 200")
    assert b"transfer-encoding" not in head.lower()
    assert b"connection: close" in head.lower()
    assert sse.data(events)[-1] == "[DONE]"
    assert all(block.startswith("data: ") for block in sse.blocks(events))
    whole = b"POST /v1/chat/completions HTTP/1.0\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
    with running.connect() as sock:
        sock.sendall(whole % len(CHAT) + CHAT)
        answer = read_to_close(sock)
    head, _, rest = answer.partition(b"\r\n\r\n")
    assert b"content-length: %d" % len(rest) in head.lower()


def test_a_connection_that_sends_nothing_is_closed_after_the_keep_alive_timeout(engine: FakeEngine) -> None:
    """Not after the (longer) header timeout: an idle new connection is an idle connection."""
    with Running(engine, header_timeout_s=60, keep_alive_timeout_s=1) as server, server.connect() as sock:
        assert closed_by_server(sock)  # within the socket's 10 s, long before the header timeout


class _Closing(asyncio.Transport):
    closed = False

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True


async def test_a_timer_the_busy_loop_held_up_gives_the_connection_one_more_poll() -> None:
    """A flood's arrivals can hold the loop past a new connection's idle timeout while its request waits unread
    in the socket (the loop runs due timers before it polls): the late timer gives it another turn, in which its
    bytes are read, rather than closing it unanswered. A timer on time still closes an idle connection."""
    from gateway.server.http import LATE_TIMER_S, HeaderTimeout

    class Probe(HeaderTimeout, asyncio.Protocol):
        idle_timeout_s = 0.05

    held, idle = Probe(), Probe()
    held_transport, idle_transport = _Closing(), _Closing()
    held.connection_made(held_transport)
    time.sleep(0.05 + LATE_TIMER_S + 0.2)  # noqa: ASYNC251 - the loop held up (a blocking stretch, not a wait)
    for _ in range(3):  # the loop's next turns: the late timer runs in the first
        await asyncio.sleep(0)
    assert not held_transport.closed
    held.data_received(b"GET /health HTTP/1.1\r\n")  # its bytes, read in that turn's poll, disarm the idle timer
    idle.connection_made(idle_transport)
    await waits.until(lambda: idle_transport.closed, what="an idle connection was never closed")
    assert not held_transport.closed
