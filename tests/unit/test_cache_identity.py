"""The response cache answers only from what would answer now: its key holds each backend's identity
(`backends.registry.identity`), which changes with every part that changes an answer (an adapter's weights, a
model's dtype, quantization, context and sampling defaults, a remote's upstream) and with nothing else, so a model
served as before, in this process or another sharing the cache, keeps its hits."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.testclient import TestClient

from engine import adapters
from engine.config import EngineSettings
from engine.types import GenerationRequest, ModelInfo, SamplingOptions
from gateway.app import create_app
from gateway.backends import modelfile
from gateway.backends.startup import build_registry
from tests.adapters import write_stub
from tests.fakes import HELLO, FakeEngine, fake_settings

MODELS = """
models:
  - name: base
    engine: {{dtype: {dtype}, quantization: {quantization}, max_model_len: {max_model_len}, kv_cache_dtype: auto}}
    defaults: {{temperature: {temperature}}}
  - {{name: lora, kind: adapter, base: base, path: {adapter}, defaults: {{top_p: {top_p}}}}}
  - {{name: far, kind: remote, url: "{url}", upstream_model: {upstream_model}, defaults: {{top_k: {top_k}}}}}
"""
SAME = {"dtype": "float32", "quantization": "null", "max_model_len": 64, "temperature": 0.5, "adapter": "a",
        "top_p": 0.9, "url": "http://upstream.test/v1", "upstream_model": "m", "top_k": 5}


def _start(settings: EngineSettings) -> FakeEngine:
    """The fake engine as vLLM would report the settings: its context, and the sampling defaults it applies."""
    return FakeEngine(settings.served_model_name, max_model_len=settings.max_model_len or 64,
                      defaults=settings.sampling_defaults, max_loras=settings.max_loras if settings.enable_lora else None)


def _identities(tmp_path: Path, gateway: dict[str, Any] | None = None, **changed: Any) -> dict[str, str]:
    values = {**SAME, **changed}
    values["adapter"] = tmp_path / values["adapter"]
    (tmp_path / "models.yaml").write_text(MODELS.format(**values))
    settings = fake_settings(models_file=tmp_path / "models.yaml", **(gateway or {}))
    registry = build_registry(modelfile.load(settings), settings, _start, lambda *_: None)
    return {name: backend.identity for name, backend in registry.backends.items()}


@pytest.fixture
def stubs(tmp_path: Path) -> Path:
    write_stub(tmp_path / "a")
    write_stub(tmp_path / "a-copy")  # the same files elsewhere: the same weights
    write_stub(tmp_path / "other", rank=16)  # other weights
    return tmp_path


# (what changes, the models file's values changed or the gateway's settings, the backends whose answers it changes)
CHANGES: list[tuple[str, dict[str, Any], dict[str, Any] | None, set[str]]] = [
    ("dtype", {"dtype": "bfloat16"}, None, {"base", "lora"}),
    ("quantization", {"quantization": "fp8"}, None, {"base", "lora"}),
    ("max_model_len", {"max_model_len": 32}, None, {"base", "lora"}),
    ("the model's sampling defaults", {"temperature": 0.7}, None, {"base", "lora"}),
    ("the adapter's weights", {"adapter": "other"}, None, {"lora"}),
    ("the adapter's sampling defaults", {"top_p": 0.5}, None, {"lora"}),
    ("the upstream", {"url": "http://elsewhere.test/v1"}, None, {"far"}),
    ("the upstream's model", {"upstream_model": "n"}, None, {"far"}),
    ("the remote's sampling defaults", {"top_k": 7}, None, {"far"}),
    ("the gateway's default max_tokens", {}, {"default_max_tokens": 9}, {"base", "lora", "far"}),
    ("the gateway's output bound", {}, {"max_output_tokens_per_request": 99}, {"base", "lora", "far"}),
    # what changes no answer keeps every hit
    ("the adapter's files copied elsewhere", {"adapter": "a-copy"}, None, set()),
    ("the engine's capacity", {}, {"engine": EngineSettings(served_model_name="fake-model", max_num_seqs=3)}, set()),
    ("the cache's own settings", {}, {"cache": {"backend": "memory", "ttl_s": 5}}, set()),
    ("nothing", {}, None, set()),
]


@pytest.mark.parametrize(("what", "changed", "gateway", "answers"), CHANGES, ids=[c[0] for c in CHANGES])
def test_each_part_of_what_answers_is_in_its_identity(
    stubs: Path, what: str, changed: dict[str, Any], gateway: dict[str, Any] | None, answers: set[str]
) -> None:
    before = _identities(stubs)
    after = _identities(stubs, gateway, **changed)
    assert {name for name in before if before[name] != after[name]} == answers, what
    assert all(len(found) == 64 for found in after.values())


@pytest.fixture
def served(tmp_path: Path) -> Iterator[Callable[[], TestClient]]:
    write_stub(tmp_path / "a")
    write_stub(tmp_path / "b", rank=16)
    (tmp_path / "models.yaml").write_text("models:\n  - {name: base, engine: {enable_lora: true, max_loras: 2}}\n")
    settings = fake_settings(models_file=tmp_path / "models.yaml", admin_keys=["sk-admin"], cache={"backend": "memory"})
    with TestClient(create_app(settings, engine_starter=_start)) as client:
        yield lambda: client


ADMIN = {"Authorization": "Bearer sk-admin"}


def _load(client: TestClient, path: Path) -> None:
    loaded = client.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(path)}, headers=ADMIN)
    assert loaded.status_code == 200, loaded.text


def _cached(client: TestClient, stream: bool = False) -> str:
    body = {"model": "x", "messages": HELLO, "max_tokens": 3, "temperature": 0, "stream": stream}
    answer = client.post("/v1/chat/completions", json=body)
    assert answer.status_code == 200, answer.text
    return answer.headers["x-cache"]


@pytest.mark.parametrize("stream", [False, True])
def test_an_adapter_loaded_again_from_other_weights_is_not_answered_from_the_cache(
    served: Callable[[], TestClient], tmp_path: Path, stream: bool
) -> None:
    client = served()
    _load(client, tmp_path / "a")
    assert [_cached(client, stream), _cached(client, stream)] == ["MISS", "HIT"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=ADMIN).status_code == 200
    _load(client, tmp_path / "b")  # the same name, other weights
    assert [_cached(client, stream), _cached(client, stream)] == ["MISS", "HIT"]
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=ADMIN).status_code == 200
    write_stub(tmp_path / "b", rank=8, hidden=8)  # other weights written over the same path
    _load(client, tmp_path / "b")
    assert _cached(client, stream) == "MISS"
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "x"}, headers=ADMIN).status_code == 200
    _load(client, tmp_path / "a")  # the first weights again: their answers are still good
    assert _cached(client, stream) == "HIT"


def _vllm_engine(prompts: list[dict[str, Any]]) -> Any:
    """The vLLM engine over a stand-in for vLLM's AsyncLLM that takes every adapter and keeps each prompt given."""
    pytest.importorskip("vllm")
    from engine.vllm_engine import VLLMEngine

    async def generate(prompt: dict[str, Any], *args: Any, **kwargs: Any) -> AsyncIterator[Any]:
        prompts.append(prompt)
        return
        yield

    async def added(request: Any) -> bool:
        return True

    async def removed(adapter_id: int) -> None:
        pass

    tokenizer = SimpleNamespace(get_added_vocab=dict, chat_template="")
    llm = SimpleNamespace(get_tokenizer=lambda: tokenizer, generate=generate, add_lora=added, remove_lora=removed,
                          model_config=SimpleNamespace(get_hidden_size=lambda: 4),
                          vllm_config=SimpleNamespace(lora_config=SimpleNamespace(max_lora_rank=8)))
    return VLLMEngine(llm, ModelInfo("base", 64), lora=True)  # type: ignore[arg-type]


def test_each_load_of_an_adapter_has_kv_blocks_of_its_own_in_vllm(tmp_path: Path) -> None:
    """vLLM keys an adapter's cached KV blocks by its name and path: each load salts its prompts with its own id, so an
    adapter loaded again under its name from a directory with other weights written over it reuses no block the old
    weights computed; the base's prompts are unsalted (their prefixes are shared as before)."""
    prompts: list[dict[str, Any]] = []
    engine = _vllm_engine(prompts)
    folder = write_stub(tmp_path / "x")

    async def asked(adapter: str | None) -> None:
        request = GenerationRequest("r", [1, 2, 3], SamplingOptions(max_tokens=1), adapter=adapter)
        async for _ in engine.generate(request):
            pass

    async def loads() -> None:
        for _ in range(2):
            await engine.load_adapter("x", str(folder))
            await asked("x")
            await engine.unload_adapter("x")
            write_stub(folder, rank=8, hidden=4)  # (the same shapes: what vLLM is given is the same name and path)
        await asked(None)

    asyncio.run(loads())
    first, again, base = (prompt.get("cache_salt") for prompt in prompts)
    assert None not in (first, again)
    assert first != again
    assert base is None


def test_the_vllm_engine_reads_an_adapter_s_files_off_the_event_loop(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A client's directory may hold a config or a safetensors header of any size: reading it blocks no request."""
    engine, read = _vllm_engine([]), adapters.read
    threads: list[threading.Thread] = []
    monkeypatch.setattr(adapters, "read", lambda path: threads.append(threading.current_thread()) or read(path))
    asyncio.run(engine.load_adapter("x", str(write_stub(tmp_path / "x"))))
    assert threads
    assert threading.main_thread() not in threads
