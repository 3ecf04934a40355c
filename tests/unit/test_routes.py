"""The one route table: every route the app serves is in it, and the access log, auth, the
lifecycle and the OpenAPI document all take their paths from it."""

from __future__ import annotations

import asyncio
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest
from starlette.routing import Route
from starlette.testclient import TestClient

from engine.config import EngineSettings
from gateway.apis.routes import TABLE
from gateway.app import create_app
from gateway.web.table import Endpoint, RouteTable
from tests.adapters import write_stub
from tests.fakes import FakeEngine, fake_settings

ADMIN_KEY = "sk-admin"
STUB_ADAPTER = write_stub(Path(tempfile.mkdtemp(prefix="route-adapter-")))

BODIES: dict[str, dict[str, Any]] = {
    "/v1/chat/completions": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/completions": {"model": "fake-model", "prompt": "hi", "max_tokens": 2},
    "/v1/embeddings": {"model": "fake-embed", "input": "hi"},
    "/v1/messages": {"model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/messages/batches": {"requests": [{"custom_id": "r1", "params": {
        "model": "fake-model", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}}]},
    "/v1/messages/count_tokens": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]},
    "/tokenize": {"model": "fake-model", "prompt": "hi"},
    "/detokenize": {"model": "fake-model", "tokens": [10]},
    "/generate": {"prompt": "hi", "max_tokens": 2},
    "/stream-generate": {"prompt": "hi", "max_tokens": 2},
    "/chat": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
    "/v1/responses": {"model": "fake-model", "input": "hi", "max_output_tokens": 16},
    "/v1/conversations": {"items": [{"role": "user", "content": "hi", "id": "msg_route"}]},
    "/v1/conversations/{conversation_id}": {"metadata": {"k": "v"}},
    "/v1/conversations/{conversation_id}/items": {"items": [{"role": "user", "content": "more"}]},
    "/v1/load_lora_adapter": {"lora_name": "route-lora", "lora_path": str(STUB_ADAPTER)},
    "/v1/unload_lora_adapter": {"lora_name": "route-lora"},
    "/mcp": {"jsonrpc": "2.0", "id": 1, "method": "tools/list"},
}
HEADERS = {"/mcp": {"accept": "application/json, text/event-stream"}}  # MCP's streamable HTTP asks for both


def app_with(**overrides: Any) -> Any:
    """A chat model (fake-model, serving adapters) and an embedding model (fake-embed), on fake
    engines; an admin key."""
    engine = EngineSettings(served_model_name="fake-model", enable_lora=True)
    # batches created here wait on disk (no runner): retrieved and cancelled whatever the timing
    overrides.setdefault("batches", {"enabled": False, "dir": tempfile.mkdtemp(prefix="route-batches-")})
    overrides.setdefault("streams", {"resumable": True})  # the resume routes answer
    settings = fake_settings(embedding_model="fake-embed", admin_keys=[ADMIN_KEY], engine=engine, **overrides)
    return create_app(settings, engine_starter=lambda es: FakeEngine(
        es.served_model_name, task=es.task, max_loras=2 if es.enable_lora and es.task == "generate" else None))


BATCH_LINE = b'{"custom_id": "r1", "method": "POST", "url": "/v1/chat/completions", "body": {"model": "fake-model"}}\n'


def upload(client: TestClient, headers: dict[str, str]) -> Any:
    return client.post("/v1/files", files={"file": ("in.jsonl", BATCH_LINE)}, data={"purpose": "batch"},
                       headers={"authorization": "Bearer unused", **headers})


def concrete(client: TestClient, path: str, headers: dict[str, str]) -> str:
    """A path with its parameters filled in: /v1/responses/{response_id} names a fresh (background)
    response, /v1/files/{file_id} a fresh upload, when the app lets one be made."""
    if "{file_id}" in path:
        made = upload(client, headers)
        return path.replace("{file_id}", made.json()["id"] if made.status_code == 200 else "file-none")
    if "{batch_id}" in path:
        made = client.post("/v1/batches", json=batch_body(client, headers), headers=headers)
        return path.replace("{batch_id}", made.json()["id"] if made.status_code == 200 else "batch_none")
    if "{message_batch_id}" in path:
        made = client.post("/v1/messages/batches", json=BODIES["/v1/messages/batches"], headers=headers)
        batch_id = made.json()["id"] if made.status_code == 200 else "msgbatch_none"
        if made.status_code == 200 and not path.endswith("/cancel"):
            ended(client, batch_id)  # its results and its delete need it ended
        return path.replace("{message_batch_id}", batch_id)
    if "{conversation_id}" in path:
        made = client.post("/v1/conversations", json=BODIES["/v1/conversations"], headers=headers)
        path = path.replace("{conversation_id}", made.json()["id"] if made.status_code == 200 else "conv_none")
        return path.replace("{item_id}", "msg_route")
    if "{stream_id}" in path:  # a fresh stream of the API the path resumes
        created = path.removesuffix("/streams/{stream_id}")
        streamed = {} if created == "/stream-generate" else {"stream": True}  # its path alone says it streams
        made = client.post(created, json={**BODIES[created], **streamed}, headers=headers)
        return path.replace("{stream_id}", made.headers.get("x-stream-id", "strm_none"))
    if "{response_id}" not in path:
        return path.replace("{model:path}", "fake-model")
    made = client.post("/v1/responses", json={**BODIES["/v1/responses"], "background": True}, headers=headers)
    return path.replace("{response_id}", made.json()["id"] if made.status_code == 200 else "resp_none")


def ended(client: TestClient, batch_id: str) -> None:
    """The batch marked completed on disk, as a runner would leave it (none runs here)."""
    records = client.app_state["gateway"].batches.records

    async def end() -> None:
        token = await records.claim(batch_id, "test", 30)
        stored = await records.batch(batch_id)
        stored.batch.status, stored.batch.completed_at = "completed", int(time.time())
        await records.save(stored, token)

    asyncio.run(end())


def batch_body(client: TestClient, headers: dict[str, str]) -> dict[str, Any]:
    """A batch of a fresh upload (when the app lets one be made)."""
    made = upload(client, headers)
    file_id = made.json()["id"] if made.status_code == 200 else "file-none"
    return {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}


def call(client: TestClient, endpoint: Endpoint, **headers: str) -> Any:
    """The endpoint called with `headers` (an admin route without any: with the admin key)."""
    if endpoint.access == "admin" and not headers:
        headers = {"authorization": f"Bearer {ADMIN_KEY}"}
    if endpoint.upload:
        return upload(client, headers)
    path = concrete(client, endpoint.path, headers)
    body = batch_body(client, headers) if (endpoint.method, path) == ("POST", "/v1/batches") else BODIES.get(endpoint.path)
    return client.request(endpoint.method, path, json=body, headers={**HEADERS.get(endpoint.path, {}), **headers})


def test_every_route_of_the_app_is_in_the_table() -> None:
    app = app_with()
    served = {(r.path, m) for r in app.routes if isinstance(r, Route) for m in (r.methods or ()) if m != "HEAD"}
    assert served == {(e.path, e.method) for e in TABLE.endpoints}
    assert all(isinstance(r, Route) for r in app.routes)


def answered(route: str) -> float:
    """gateway_requests_total of a route label with status 200, over all models. From that counter alone (what the
    registry exports for it): collecting the whole registry, with every series the process's tests have left in
    it, took seconds a route."""
    from gateway.telemetry.metrics import REQUESTS

    return sum(sample.value for metric in REQUESTS.collect() if metric.name == "gateway_requests"
               for sample in metric.samples
               if sample.name == "gateway_requests_total" and sample.labels["route"] == route
               and sample.labels["status"] == "200")


def test_every_route_answers_and_is_labelled_with_its_path() -> None:
    with TestClient(app_with()) as client:
        for endpoint in TABLE.endpoints:
            before = answered(endpoint.path)
            response = call(client, endpoint)
            assert response.status_code == 200, (endpoint.path, response.text)
            assert answered(endpoint.path) == before + 1, endpoint.path
    assert TABLE.label("/no/such/path") == "unmatched"
    assert (TABLE.dialect("/v1/messages"), TABLE.dialect("/v1/chat/completions")) == ("anthropic", "openai")
    assert TABLE.dialect("/no/such/path") == "openai"


def test_paths_with_parameters_are_labelled_with_their_template() -> None:
    assert TABLE.label("/v1/responses/resp_1") == "/v1/responses/{response_id}"
    assert TABLE.label("/v1/responses/resp_1/input_items") == "/v1/responses/{response_id}/input_items"
    assert TABLE.label("/v1/responses/resp_1/cancel") == "/v1/responses/{response_id}/cancel"
    assert TABLE.label("/v1/responses/resp_1/other") == TABLE.label("/v1/responses/a/b") == "unmatched"


@pytest.mark.parametrize("protect_ops", [False, True])
def test_auth_guards_exactly_the_table_s_keyed_routes(protect_ops: bool) -> None:
    with TestClient(app_with(api_keys=["sk-route"], auth_ops_routes=protect_ops)) as client:
        for endpoint in TABLE.endpoints:
            keyed = endpoint.access in ("api", "admin") or (endpoint.access == "ops" and protect_ops)
            response = call(client, endpoint, **({"x-no-key": "1"} if endpoint.access == "admin" else {}))
            assert (response.status_code == 401) == keyed, (endpoint.path, response.status_code)
            if keyed:  # in the route's own dialect
                shape = {"type", "error"} if endpoint.dialect == "anthropic" else {"error"}
                assert set(response.json()) == shape, endpoint.path
            with_key = call(client, endpoint, authorization="Bearer sk-route")
            if endpoint.access == "admin":  # an API key is no admin key
                assert with_key.status_code == 401, endpoint.path
                with_key = call(client, endpoint)
            assert with_key.status_code == 200, endpoint.path


def test_draining_refuses_all_but_the_ops_routes() -> None:
    from gateway.pipeline.lifecycle import Lifecycle

    lifecycle = Lifecycle()
    engine = FakeEngine()
    app = create_app(fake_settings(), engine_starter=lambda _: engine, lifecycle=lifecycle)
    with TestClient(app) as client:
        lifecycle.start_drain()
        for endpoint in TABLE.endpoints:
            status = call(client, endpoint).status_code
            if endpoint.path == "/ready":
                assert status == 503
                assert call(client, endpoint).json()["status"] == "draining"
            elif endpoint.access == "ops":
                assert status == 200, endpoint.path
            else:
                assert status == 503, endpoint.path


def test_openapi_documents_every_route_of_the_table() -> None:
    with TestClient(app_with()) as client:
        paths = client.get("/openapi.json").json()["paths"]
    assert {(path, method.upper()) for path, ops in paths.items() for method in ops} == {
        (e.template, e.method) for e in TABLE.endpoints
    }
    for endpoint in TABLE.endpoints:
        operation = paths[endpoint.template][endpoint.method.lower()]
        if endpoint.upload:
            assert set(operation["requestBody"]["content"]["multipart/form-data"]["schema"]["required"]) == {"file", "purpose"}
        elif endpoint.request is not None:
            body = operation["requestBody"]
            assert body["content"]["application/json"]["schema"]["$ref"].endswith(endpoint.request.__name__)
        if "{response_id}" in endpoint.path:
            assert operation["parameters"] == [{"name": "response_id", "in": "path", "required": True,
                                                "schema": {"type": "string"}}]
        if "{model:path}" in endpoint.path:
            assert operation["parameters"] == [{"name": "model", "in": "path", "required": True,
                                                "schema": {"type": "string"}}]


def test_a_route_added_to_the_table_reaches_every_layer() -> None:
    async def handler(request: Any) -> Any:
        raise AssertionError("not called")

    extra = Endpoint("GET", "/v1/extra", handler, "api", "An extra route")
    table = RouteTable([*TABLE.endpoints, extra])
    assert "/v1/extra" in {r.path for r in table.routes()}
    assert table.label("/v1/extra") == "/v1/extra"
    assert "/v1/extra" in table.paths("api")
    assert "/v1/extra" not in table.paths("open", "ops")


def test_one_handler_per_method_of_a_path() -> None:
    async def other(request: Any) -> Any:
        raise AssertionError("not called")

    first = TABLE.endpoints[0]
    with pytest.raises(ValueError, match="one handler per method of a path"):
        RouteTable([first, Endpoint(first.method, first.path, other, "api", "clash")]).routes()


# requests through the app: Starlette's own router and exception middleware answer them, errors
# included, in the API's shape (no router of our own)
SAME_AS_STARLETTE: list[tuple[str, str, Any]] = [
    ("GET", "/v1/models", None),
    ("HEAD", "/v1/models", None),  # HEAD where GET is
    ("GET", "/health", None),
    ("GET", "/v1/nothing", None),  # 404
    ("GET", "/health/", None),  # no slash redirect
    ("GET", "/v1/chat/completions", None),  # 405 with Allow
    ("HEAD", "/v1/chat/completions", None),
    ("DELETE", "/v1/models", None),
    ("GET", "/v1/messages", None),  # 405 in Anthropic's shape
    ("POST", "/v1/messages", {"model": "fake-model"}),  # 400 in Anthropic's shape
    ("POST", "/v1/chat/completions", {"model": "fake-model", "messages": []}),  # a validation error
    ("POST", "/v1/chat/completions", {"model": "no-such", "messages": [{"role": "user", "content": "hi"}]}),
    ("POST", "/v1/chat/completions", BODIES["/v1/chat/completions"]),
    ("GET", "/v1/responses/resp_none", None),  # a path parameter, then a 404 of the handler's
    ("PUT", "/v1/responses/resp_none", None),  # 405 on a path with a parameter
    ("GET", "/v1/responses/resp_none/cancel", None),
    ("POST", "/v1/responses/resp_none/cancel", None),
    ("GET", "/v1/responses/resp_none/input_items", None),
    ("GET", "/v1/responses/a/b/c", None),  # 404 past the templates
    ("POST", "/v1/completions", b"{not json"),
]


def answers(app: Any, root_path: str = "") -> list[tuple[int, dict[str, str], bytes]]:
    out = []
    with TestClient(app, raise_server_exceptions=False, root_path=root_path) as client:  # paths under it
        for method, path, body in SAME_AS_STARLETTE:
            content = body if isinstance(body, bytes) else None
            response = client.request(method, root_path + path, json=None if content else body, content=content,
                                      headers={"X-Request-ID": "same", "Content-Type": "application/json"})
            headers = dict(response.headers)
            if response.status_code == 200:  # ids and timestamps of a generated answer differ
                headers.pop("content-length")
            out.append((response.status_code, headers, b"" if response.status_code == 200 else response.content))
    return out


@pytest.mark.parametrize("root_path", ["", "/gw"])
def test_starlette_s_router_answers_every_kind_of_path(root_path: str) -> None:
    from starlette.middleware.exceptions import ExceptionMiddleware
    from starlette.routing import Router

    app = app_with()
    ours = answers(app, root_path)
    assert [status for status, _, _ in ours] == [200, 200, 200, 404, 404, 405, 405, 405, 405, 400, 400, 404, 200,
                                                 404, 405, 405, 404, 404, 404, 400]
    assert type(app.router) is Router  # Starlette's, not a fork
    layer = app.middleware_stack
    while layer is not None and not isinstance(layer, ExceptionMiddleware):
        layer = getattr(layer, "app", None)
    assert layer is not None
    assert layer.app is app.router
    errors = [body for (status, _, body), (method, _, _) in zip(ours, SAME_AS_STARLETTE, strict=True)
              if status >= 400 and method != "HEAD"]
    assert len(errors) == 15
    assert all(b'"error"' in body for body in errors)
