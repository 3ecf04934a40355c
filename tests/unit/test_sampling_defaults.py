"""Sampling defaults: what a request leaves unsaid comes from the model (its generation config, with
the models file's `defaults` over it), then from OpenAI; chat's output budget too, completions keep
16 as OpenAI and vLLM do. The same on the native routes, and added to a remote model's payload."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine.config import EngineSettings, SamplingDefaults
from engine.types import SamplingOptions
from gateway.app import create_app
from gateway.backends import modelfile
from gateway.backends.upstream import with_defaults
from gateway.settings import merged
from tests.fakes import FakeEngine, chat_body, fake_settings

MODEL_DEFAULTS = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=20, repetition_penalty=1.1, max_tokens=5)
HELLO = [{"role": "user", "content": "hi"}]


def sampled(engine: FakeEngine, route: str, body: dict[str, Any], **settings: Any) -> SamplingOptions:
    app = create_app(fake_settings(**settings), engine_starter=lambda es: engine)
    with TestClient(app) as client:
        answer = client.post(route, json=body)
        assert answer.status_code == 200, answer.text
    return engine.requests[-1].sampling


def test_chat_takes_the_model_defaults_where_the_request_is_silent() -> None:
    options = sampled(FakeEngine(defaults=MODEL_DEFAULTS), "/v1/chat/completions", {"model": "fake-model", "messages": HELLO})
    assert (options.temperature, options.top_p, options.top_k, options.repetition_penalty) == (0.6, 0.9, 20, 1.1)
    assert options.max_tokens == 5
    assert (options.min_p, options.presence_penalty, options.frequency_penalty) == (0.0, 0.0, 0.0)  # OpenAI's


def test_what_the_request_says_wins() -> None:
    body = {"model": "fake-model", "messages": HELLO, "temperature": 0, "top_p": 1, "top_k": -1, "max_tokens": 3,
            "repetition_penalty": 1.0, "presence_penalty": 0.0}
    options = sampled(FakeEngine(defaults=merged(SamplingDefaults(presence_penalty=0.5), MODEL_DEFAULTS)),
                      "/v1/chat/completions", body)
    assert (options.temperature, options.top_p, options.top_k, options.max_tokens) == (0.0, 1.0, 0, 3)
    assert (options.repetition_penalty, options.presence_penalty) == (1.0, 0.0)  # an explicit 0 is not silence


def test_explicit_null_is_silence() -> None:
    body = {"model": "fake-model", "messages": HELLO, "temperature": None, "top_p": None}
    options = sampled(FakeEngine(defaults=MODEL_DEFAULTS), "/v1/chat/completions", body)
    assert (options.temperature, options.top_p) == (0.6, 0.9)


def test_without_model_defaults_openai_defaults_apply() -> None:
    options = sampled(FakeEngine(max_model_len=64), "/v1/chat/completions", {"model": "fake-model", "messages": HELLO})
    assert (options.temperature, options.top_p, options.top_k, options.repetition_penalty) == (1.0, 1.0, 0, 1.0)
    assert options.max_tokens == 64 - 3  # what the context leaves ("<user> hi <assistant>": 3 words)


def test_the_model_output_budget_comes_before_the_gateway_wide_one() -> None:
    silent = {"model": "fake-model", "messages": HELLO}
    assert sampled(FakeEngine(defaults=MODEL_DEFAULTS), "/v1/chat/completions", silent, default_max_tokens=9).max_tokens == 5
    assert sampled(FakeEngine(), "/v1/chat/completions", silent, default_max_tokens=9).max_tokens == 9


def test_completions_take_sampling_defaults_but_keep_16_tokens() -> None:
    options = sampled(FakeEngine(defaults=MODEL_DEFAULTS), "/v1/completions", {"model": "fake-model", "prompt": "hi"})
    assert (options.temperature, options.top_k, options.max_tokens) == (0.6, 20, 16)


@pytest.mark.parametrize(
    ("route", "body", "max_tokens"),
    [
        ("/generate", {"prompt": "hi"}, 16),
        ("/stream-generate", {"prompt": "hi"}, 16),
        ("/chat", {"messages": HELLO}, 5),
        ("/chat", {"messages": HELLO, "stream": True}, 5),
        ("/chat", {"messages": HELLO, "temperature": 1.5, "max_tokens": 2}, 2),
    ],
)
def test_native_routes_take_the_same_defaults(route: str, body: dict[str, Any], max_tokens: int) -> None:
    options = sampled(FakeEngine(defaults=MODEL_DEFAULTS), route, body)
    assert options.temperature == body.get("temperature", 0.6)
    assert options.top_p == 0.9
    assert options.max_tokens == max_tokens


def test_models_file_defaults_go_over_the_engine_settings(tmp_path: Path) -> None:
    """Embedded: the file's `defaults` reach the engine (vLLM's override_generation_config), over
    those of the `engine` settings (GATEWAY_ENGINE__SAMPLING_DEFAULTS__*)."""
    path = tmp_path / "models.yaml"
    path.write_text("models: [{name: a, defaults: {temperature: 0.2, max_tokens: 64}, engine: {generation_config: vllm}}]")
    base = EngineSettings(sampling_defaults=SamplingDefaults(temperature=0.9, top_p=0.5))
    settings = fake_settings(models_file=path, engine=base)
    [spec] = modelfile.load(settings).models
    engine = spec.engine_settings(settings.engine)
    assert engine.sampling_defaults == SamplingDefaults(temperature=0.2, top_p=0.5, max_tokens=64)
    assert engine.generation_config == "vllm"
    assert engine.sampling_defaults.as_generation_config() == {"temperature": 0.2, "top_p": 0.5, "max_new_tokens": 64}


def test_bad_defaults_are_refused(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    for text, problem in [("models: [{name: a, defaults: {temprature: 0.2}}]", "temprature"),
                          ("models: [{name: a, defaults: {top_p: 3}}]", "top_p")]:
        path.write_text(text)
        with pytest.raises(modelfile.ConfigError, match=problem):
            modelfile.load(fake_settings(models_file=path))


def test_generation_config_as_vllm_reads_it() -> None:
    """`get_diff_sampling_param()`'s dict (HF's max_new_tokens already renamed max_tokens)."""
    diff = {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 256,
            "stop_token_ids": [2]}
    assert SamplingDefaults.from_generation_config(diff) == SamplingDefaults(
        temperature=0.7, top_p=0.8, top_k=20, repetition_penalty=1.05, max_tokens=256)
    assert SamplingDefaults.from_generation_config({}) == SamplingDefaults()


def test_remote_models_get_their_defaults_in_the_payload() -> None:
    defaults = SamplingDefaults(temperature=0.3, top_k=5, max_tokens=7)
    chat = with_defaults({"model": "m", "messages": HELLO, "temperature": 1.0}, defaults, output_budget=True)
    assert chat == {"model": "m", "messages": HELLO, "temperature": 1.0, "top_k": 5, "max_tokens": 7}
    budgeted = with_defaults({"model": "m", "max_completion_tokens": 3}, defaults, output_budget=True)
    assert "max_tokens" not in budgeted
    completion = with_defaults({"model": "m", "prompt": "a"}, defaults, output_budget=False)
    assert completion == {"model": "m", "prompt": "a", "temperature": 0.3, "top_k": 5}
    assert with_defaults({"model": "m"}, None, output_budget=True) == {"model": "m"}


def test_fallback_answers_with_its_own_defaults(tmp_path: Path) -> None:
    path = tmp_path / "models.yaml"
    path.write_text("models: [{name: a, fallback: [b]}, {name: b}]")
    engines = {"a": FakeEngine("a", defaults=SamplingDefaults(temperature=0.1)),
               "b": FakeEngine("b", defaults=SamplingDefaults(temperature=0.8))}
    engines["a"].dead = True
    app = create_app(fake_settings(models_file=path), engine_starter=lambda es: engines[es.served_model_name])
    with TestClient(app) as client:
        assert client.post("/v1/chat/completions", json=chat_body("a")).headers["x-served-model"] == "b"
    assert engines["b"].requests[0].sampling.temperature == 0.8
