from __future__ import annotations

import gc
import os
import subprocess
import sys
import textwrap

import openai
import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.server.cli import parser, settings_from
from tests.fakes import fake_settings


def test_models_lists_the_engine(sdk: openai.OpenAI) -> None:
    models = sdk.models.list()
    assert [m.id for m in models.data] == ["fake-model"]
    assert models.data[0].object == "model"


def test_a_model_is_retrieved_by_its_id(sdk: openai.OpenAI, client: TestClient) -> None:
    model = sdk.models.retrieve("fake-model")
    assert (model.id, model.object) == ("fake-model", "model")
    assert client.get("/v1/models/fake-model").json() == client.get("/v1/models").json()["data"][0]
    with pytest.raises(openai.NotFoundError) as missing:
        sdk.models.retrieve("org/ghost")  # an id with a slash reaches the handler too
    assert missing.value.status_code == 404
    assert missing.value.body["code"] == "model_not_found"
    assert missing.value.body["param"] == "model"
    assert "org/ghost" in missing.value.body["message"]


def test_health(client: TestClient) -> None:
    assert client.get("/health").json() == {"status": "ok"}


def test_request_id_is_honoured_or_generated(client: TestClient) -> None:
    assert client.get("/health", headers={"X-Request-ID": "abc-123"}).headers["x-request-id"] == "abc-123"
    generated = client.get("/health").headers["x-request-id"]
    assert len(generated) == 32
    visible = "".join(chr(c) for c in range(0x21, 0x7F))
    assert client.get("/health", headers={"X-Request-ID": visible}).headers["x-request-id"] == visible


@pytest.mark.parametrize("sent", ["café".encode(), b"a b", b"tab\there", b"x" * 201, b"", b"\x7f"])
def test_a_request_id_that_is_not_short_visible_ascii_is_replaced(client: TestClient, sent: bytes) -> None:
    returned = client.get("/health", headers=[(b"x-request-id", sent)]).headers["x-request-id"]
    assert returned != sent.decode("latin-1")
    assert len(returned) == 32
    assert returned.isalnum()


def test_gateway_imports_without_vllm_or_torch() -> None:
    code = textwrap.dedent(
        """
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("vllm", "torch", "transformers"):
                    raise ImportError("blocked: " + name)
        sys.meta_path.insert(0, Block())
        import gateway.app, gateway.server.cli, gateway.apis.routes, engine
        print("ok")
        """
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.stdout.strip() == "ok", result.stderr


def test_cli_flags_override_environment(monkeypatch) -> None:
    monkeypatch.setenv("GATEWAY_PORT", "9001")
    monkeypatch.setenv("GATEWAY_ENGINE__MAX_MODEL_LEN", "1024")
    monkeypatch.setenv("GATEWAY_ENGINE__ENFORCE_EAGER", "true")
    args = parser().parse_args(["serve", "--max-model-len", "512", "--engine-arg", "kv_offloading_size=4"])
    settings = settings_from(args)
    assert settings.port == 9001
    assert settings.engine.max_model_len == 512
    assert settings.engine.enforce_eager is True
    assert settings.engine.engine_args == {"kv_offloading_size": 4}


def test_warmup_runs_one_json_request_before_serving(engine) -> None:
    from gateway.app import create_app

    app = create_app(fake_settings(warmup=True), engine_starter=lambda es: engine)
    with TestClient(app):
        assert len(engine.requests) == 1
        assert engine.requests[0].sampling.json_object


def test_bad_configuration_is_refused_at_start_up(tmp_path) -> None:
    bad = tmp_path / "models.yaml"
    bad.write_text("models: [{name: a, fallback: [ghost]}]")
    cases = [({"GATEWAY_MODELS_FILE": str(bad)}, "ghost"), ({"GATEWAY_CACHE__BACKEND": "redis"}, "redis_url"),
             ({"GATEWAY_PORT": "not-a-port"}, "port")]
    # side by side: each process is seconds of start-up before it refuses
    started = [subprocess.Popen([sys.executable, "-m", "gateway", "serve"], stdout=subprocess.DEVNULL,
                                stderr=subprocess.PIPE, text=True, env={**os.environ, **env}) for env, _ in cases]
    try:
        for process, (_, named) in zip(started, cases, strict=True):
            _, stderr = process.communicate(timeout=60)
            assert process.returncode == 2
            assert "configuration error" in stderr
            assert named in stderr
    finally:
        for process in started:
            process.kill()
            process.wait()


def test_vllm_logs_follow_the_gateway_log_settings(monkeypatch, tmp_path) -> None:
    """JSON logs: vLLM's own lines (front end, engine core, worker) become JSON too, at our level;
    the engine settings (also per model in a models file) may still say otherwise."""
    from gateway.backends import modelfile

    monkeypatch.setenv("GATEWAY_LOG_FORMAT", "json")
    monkeypatch.setenv("GATEWAY_LOG_LEVEL", "warning")
    settings = settings_from(parser().parse_args(["serve"]))
    assert (settings.engine.log_format, settings.engine.log_level) == ("json", "warning")
    models = tmp_path / "models.yaml"
    models.write_text("models: [{name: a}, {name: b, engine: {log_level: debug}}]")
    monkeypatch.setenv("GATEWAY_MODELS_FILE", str(models))
    specs = modelfile.load(settings_from(parser().parse_args(["serve"]))).models
    engine_a, engine_b = (spec.engine_settings(settings.engine) for spec in specs)
    assert (engine_a.log_format, engine_a.log_level) == ("json", "warning")
    assert (engine_b.log_format, engine_b.log_level) == ("json", "debug")
    monkeypatch.delenv("GATEWAY_MODELS_FILE")
    monkeypatch.setenv("GATEWAY_LOG_FORMAT", "console")
    monkeypatch.setenv("GATEWAY_ENGINE__LOG_FORMAT", "json")
    assert settings_from(parser().parse_args(["serve"])).engine.log_format == "json"
    monkeypatch.delenv("GATEWAY_ENGINE__LOG_FORMAT")
    assert settings_from(parser().parse_args(["serve"])).engine.log_format == "text"


def test_vllm_logging_config_from_the_engine_settings() -> None:
    pytest.importorskip("vllm")
    from engine.config import EngineSettings
    from engine.vllm_engine import logging_config

    assert logging_config(EngineSettings()) is None  # vLLM's own defaults
    config = logging_config(EngineSettings(log_format="json", log_level="warning"))
    assert (config.formatter, config.log_level) == ("json", "WARNING")


def test_engine_settings_are_checked_per_embedded_model_before_start(tmp_path) -> None:
    """`serve` passes the real check (engine.check_engine_settings); its refusal names the model and the setting."""
    from engine.errors import EngineConfigError
    from gateway.app import create_app
    from gateway.backends.modelfile import ConfigError
    from tests.fakes import FakeEngine

    checked = []

    def check(settings) -> None:
        checked.append(settings.served_model_name)
        if settings.kv_cache_dtype != "auto":
            raise EngineConfigError("kv_cache_dtype", f"'{settings.kv_cache_dtype}' does not run on the CPU")

    models = tmp_path / "models.yaml"
    models.write_text("models: [{name: a, version: 1.0.0}, {name: r, kind: remote, url: 'http://127.0.0.1:9/v1'},"
                      " {name: b, engine: {kv_cache_dtype: fp8_inc}}]")
    starter = lambda es: FakeEngine(es.served_model_name)
    with pytest.raises(ConfigError, match=r"model 'b': kv_cache_dtype \(GATEWAY_ENGINE__KV_CACHE_DTYPE\): 'fp8_inc'"):
        create_app(fake_settings(models_file=models), engine_starter=starter, engine_check=check)
    assert checked == ["a@1.0.0", "b"]  # embedded models only


def test_the_startup_heap_is_frozen_while_serving_and_unfrozen_after(engine) -> None:
    before = gc.get_threshold()
    app = create_app(fake_settings(freeze_startup_heap=True, gc_young_threshold=12_345), engine_starter=lambda es: engine)
    with TestClient(app) as client:
        assert gc.get_freeze_count() > 0  # the garbage collector's full passes skip the start-up heap
        assert gc.get_threshold() == (12_345, *before[1:])
        assert client.get("/health").status_code == 200
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == before


def test_the_collector_is_left_alone_when_told(engine) -> None:
    before = gc.get_threshold()
    app = create_app(fake_settings(freeze_startup_heap=False, gc_young_threshold=0), engine_starter=lambda es: engine)
    with TestClient(app):
        assert gc.get_freeze_count() == 0
        assert gc.get_threshold() == before


@pytest.mark.parametrize("fails", [False, True])
def test_the_access_log_binds_the_request_s_context_and_puts_the_outer_one_back(fails: bool) -> None:
    """Inside the request: its id in structlog's context and its record current; after it (also
    when the app below fails), the context as it was before. Generated ids are 32 hex digits."""
    import asyncio

    import structlog
    from starlette.types import Receive, Scope, Send

    from gateway.middleware.access_log import AccessLogMiddleware
    from gateway.telemetry.record import current_record

    seen: dict[str, object] = {}

    async def app(scope: Scope, receive: Receive, send: Send) -> None:
        seen["id"] = structlog.contextvars.get_contextvars()["request_id"]
        current_record().model = "inside"
        seen["record"] = current_record()
        if fails:
            raise RuntimeError("a bug")
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})

    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    async def receive() -> dict:
        return {"type": "http.disconnect"}

    async def run() -> None:
        outer = structlog.contextvars.bind_contextvars(request_id="outer")
        try:
            scope = {"type": "http", "method": "GET", "path": "/x", "headers": []}
            await AccessLogMiddleware(app, route_label=lambda path: path)(scope, receive, send)
            assert structlog.contextvars.get_contextvars()["request_id"] == "outer"
        finally:
            structlog.contextvars.reset_contextvars(**outer)
        assert "request_id" not in structlog.contextvars.get_contextvars()

    asyncio.run(run())
    assert current_record() is not seen["record"]
    assert current_record().model is None
    request_id = dict(sent[0]["headers"])[b"x-request-id"].decode()
    assert request_id == seen["id"]
    assert len(request_id) == 32
    assert int(request_id, 16) >= 0
    assert sent[0]["status"] == (500 if fails else 200)
