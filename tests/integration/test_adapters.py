"""LoRA adapters on the real engine: two rank-8 adapters of the default model, made here with
deterministic non-zero weights, served beside their base by one engine; a third loaded and unloaded
through the admin API; per-key reach, the response cache and the metrics with adapters."""

from __future__ import annotations

import asyncio
import shutil
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest

from tests.adapters import write_adapter
from tests.integration.conftest import LORA_BASE as BASE
from tests.integration.conftest import LORA_MODELS as MODELS
from tests.integration.conftest import REPO, Shared
from tests.waits import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("adapters as models are the gateway's own")]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
ADMIN = {"Authorization": "Bearer sk-admin"}
UNUSED = "http://127.0.0.1:9"  # (the start stops at the adapter, before any upstream is asked)


@pytest.fixture(scope="module")
def gateway(lora_gateway: Callable[[], Shared]) -> str:
    """The LoRA gateway (tests/integration/conftest.py), shared with test_guards and test_engine_death."""
    return lora_gateway()[0]


def client(base: str, key: str = "sk-all") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=300)


def answer(base: str, model: str, key: str = "sk-all", **extra: object) -> openai.types.chat.ChatCompletion:
    return client(base, key).chat.completions.create(model=model, messages=QUESTION, temperature=0, max_tokens=16,
                                                     extra_headers={"Cache-Control": "no-cache"}, **extra)  # type: ignore[arg-type]


def test_each_adapter_answers_as_itself_beside_its_base(gateway: str) -> None:
    base, a, b = (answer(gateway, name) for name in (BASE, "lora-a", "lora-b"))
    assert "Paris" in (base.choices[0].message.content or "")
    texts = {base.choices[0].message.content, a.choices[0].message.content, b.choices[0].message.content}
    assert len(texts) == 3, texts  # three different models at temperature 0
    assert (base.model, a.model, b.model) == (BASE, "lora-a", "lora-b")
    assert answer(gateway, "la").choices[0].message.content == a.choices[0].message.content  # the alias


def test_two_adapters_and_the_base_in_one_batch(gateway: str) -> None:
    alone = {name: answer(gateway, name).choices[0].message.content for name in (BASE, "lora-a", "lora-b")}
    sdk = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key="sk-all", max_retries=0, timeout=300)

    async def together() -> list[tuple[str, str | None]]:
        async def one(name: str) -> tuple[str, str | None]:
            made = await sdk.chat.completions.create(model=name, messages=QUESTION, temperature=0, max_tokens=16,  # type: ignore[arg-type]
                                                     extra_headers={"Cache-Control": "no-cache"})
            return made.model, made.choices[0].message.content
        return await asyncio.gather(*(one(name) for name in ("lora-a", "lora-b", BASE) * 3))

    for model, text in asyncio.run(together()):
        assert text == alone[model], model  # each request got its own adapter, batched with the others
    exposition = httpx.get(f"{gateway}/metrics").text
    info = [line for line in exposition.splitlines() if line.startswith("vllm:lora_requests_info{")]
    # the gateway's, from the engine: what it holds, without vLLM's spare slot on the CPU
    assert info, exposition
    assert all('max_lora="3"' in line for line in info), info
    assert exposition.count("# TYPE vllm:lora_requests_info gauge") == 1  # vLLM's own gauge is not repeated
    assert 'gateway_requests_total{model="lora-b",route="/v1/chat/completions",status="200"}' in exposition


def test_a_key_reaches_only_what_it_is_granted(gateway: str) -> None:
    assert answer(gateway, "lora-a", key="sk-adapter").model == "lora-a"
    assert answer(gateway, "la", key="sk-adapter").model == "lora-a"
    for key, refused in (("sk-adapter", BASE), ("sk-adapter", "lora-b"), ("sk-base", "lora-a"), ("sk-base", "la")):
        with pytest.raises(openai.NotFoundError):
            answer(gateway, refused, key=key)
    listed = {m.id for m in client(gateway, "sk-adapter").models.list()}
    assert listed == {"lora-a", "la"}
    cards = {m.id: m for m in client(gateway).models.list()}
    assert cards["lora-a"].model_extra["parent"] == BASE  # type: ignore[index]


def cache_hits(gateway: str, model: str) -> float:
    for line in httpx.get(f"{gateway}/metrics").text.splitlines():
        if line.startswith(f'gateway_cache_hits_total{{model="{model}"}}'):
            return float(line.split()[-1])
    return 0.0


def test_the_cache_keeps_an_adapter_s_answers_apart(gateway: str) -> None:
    sdk = client(gateway)
    hits = cache_hits(gateway, "lora-b")
    ask = {"messages": QUESTION, "temperature": 0, "max_tokens": 12}
    first = sdk.chat.completions.create(model="lora-b", **ask)  # type: ignore[arg-type]
    again = sdk.chat.completions.create(model="lora-b", **ask)  # type: ignore[arg-type]
    other = sdk.chat.completions.create(model=BASE, **ask)  # type: ignore[arg-type]
    assert again.model == "lora-b"
    assert again.choices[0].message.content == first.choices[0].message.content
    assert cache_hits(gateway, "lora-b") == hits + 1  # served from the cache
    assert other.model == BASE
    assert other.choices[0].message.content != first.choices[0].message.content


def test_admin_loads_and_unloads_an_adapter_while_serving(gateway: str, adapters: dict[str, Path]) -> None:
    body = {"lora_name": "lora-c", "lora_path": str(adapters["c"])}
    assert httpx.post(f"{gateway}/v1/load_lora_adapter", json=body,
                      headers={"Authorization": "Bearer sk-all"}).status_code == 401  # an API key is no admin key
    broken = httpx.post(f"{gateway}/v1/load_lora_adapter", json={"lora_name": "nope", "lora_path": "/no/such/dir"},
                        headers=ADMIN, timeout=120)
    assert broken.status_code == 400
    assert "does not exist" in broken.json()["error"]["message"]
    misfit = write_adapter(adapters["c"].parent / "misfit", seed=4, shape={"layers": 30, "q_proj": (512, 512),
                                                                           "v_proj": (512, 192)})
    wrong = httpx.post(f"{gateway}/v1/load_lora_adapter", json={"lora_name": "misfit", "lora_path": str(misfit)},
                       headers=ADMIN, timeout=120)  # vLLM itself would take it, and compute with a part of it
    assert wrong.status_code == 400
    assert "q_proj takes 512 inputs, the model's hidden size is 576" in wrong.json()["error"]["message"]
    assert "Paris" in (answer(gateway, BASE).choices[0].message.content or "")  # the engine serves on

    loaded = httpx.post(f"{gateway}/v1/load_lora_adapter", json=body, headers=ADMIN, timeout=120)
    assert loaded.status_code == 200, loaded.text
    assert loaded.text == "Success: LoRA adapter 'lora-c' added successfully."
    text = answer(gateway, "lora-c").choices[0].message.content
    assert text not in {answer(gateway, name).choices[0].message.content for name in (BASE, "lora-a", "lora-b")}
    full = httpx.post(f"{gateway}/v1/load_lora_adapter", json={"lora_name": "lora-d", "lora_path": str(adapters["c"])},
                      headers=ADMIN, timeout=120)
    assert full.status_code == 400  # max_loras adapters loaded: on the CPU, no more (the spare slot stays empty)
    assert "holds 3 adapters at most" in full.json()["error"]["message"]

    stream = client(gateway).chat.completions.create(model="lora-c", messages=QUESTION, max_tokens=48, stream=True,  # type: ignore[arg-type]
                                                     temperature=0, extra_headers={"Cache-Control": "no-cache"},
                                                     stream_options={"include_usage": True})
    chunks = iter(stream)
    next(chunks)  # the stream is running on lora-c
    unloaded: list[httpx.Response] = []
    unloading = threading.Thread(target=lambda: unloaded.append(httpx.post(
        f"{gateway}/v1/unload_lora_adapter", json={"lora_name": "lora-c"}, headers=ADMIN, timeout=300)))
    unloading.start()

    def refused() -> bool:  # gone for new requests once the unload has begun, while the stream runs on
        try:
            answer(gateway, "lora-c")
        except openai.NotFoundError:
            return True
        return False

    until_sync(refused, 60, "lora-c refused to new requests", step_s=0.1)
    rest = list(chunks)
    unloading.join(timeout=300)
    assert rest[-1].usage is not None
    assert rest[-1].usage.completion_tokens == 48
    assert [answer.status_code for answer in unloaded] == [200]
    assert httpx.post(f"{gateway}/v1/unload_lora_adapter", json={"lora_name": "lora-c"},
                      headers=ADMIN).status_code == 404


def test_a_missing_adapter_stops_the_start_with_status_2(tmp_path: Path) -> None:
    (tmp_path / "models.yaml").write_text(MODELS.format(a=tmp_path / "missing", b=tmp_path / "missing", upstream=UNUSED))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "adapter_config.json").write_text("{not json")
    for models in (MODELS.format(a=tmp_path / "missing", b=tmp_path / "missing", upstream=UNUSED),
                   MODELS.format(a=tmp_path / "broken", b=tmp_path / "broken", upstream=UNUSED)):
        (tmp_path / "models.yaml").write_text(models)
        done = subprocess.run([sys.executable, "-m", "gateway", "serve", "--port", "0"], cwd=REPO, capture_output=True,
                              text=True, timeout=120, env={"GATEWAY_MODELS_FILE": str(tmp_path / "models.yaml"),
                                                           "PATH": "/usr/bin:/bin"})
        assert done.returncode == 2, done.stderr[-2000:]
        assert "adapter 'lora-a'" in done.stderr


def _admin(gateway: str, route: str, **body: str) -> httpx.Response:
    return httpx.post(f"{gateway}/v1/{route}_lora_adapter", json=body, headers=ADMIN, timeout=300)


def test_an_adapter_loaded_again_from_other_weights_is_not_answered_from_the_cache(
    gateway: str, adapters: dict[str, Path]
) -> None:
    """Loaded under one name, answered (and cached), unloaded, loaded again under that name from other weights: the
    answer is the new weights', never the old weights' cached text (the cache's key holds the files' digest)."""
    sdk, ask = client(gateway), {"messages": QUESTION, "temperature": 0, "max_tokens": 12}
    assert _admin(gateway, "load", lora_name="lora-x", lora_path=str(adapters["a"])).status_code == 200
    try:
        first = sdk.chat.completions.create(model="lora-x", **ask).choices[0].message.content  # type: ignore[call-overload]
        hits = cache_hits(gateway, "lora-x")
        assert sdk.chat.completions.create(model="lora-x", **ask).choices[0].message.content == first  # type: ignore[call-overload]
        assert cache_hits(gateway, "lora-x") == hits + 1  # cached
    finally:
        assert _admin(gateway, "unload", lora_name="lora-x").status_code == 200
    assert _admin(gateway, "load", lora_name="lora-x", lora_path=str(adapters["b"])).status_code == 200
    try:
        again = sdk.chat.completions.create(model="lora-x", **ask).choices[0].message.content  # type: ignore[call-overload]
        assert cache_hits(gateway, "lora-x") == hits + 1  # not from the cache
        fresh = sdk.chat.completions.create(model="lora-b", extra_headers={"Cache-Control": "no-cache"}, **ask)  # type: ignore[call-overload]
        assert again == fresh.choices[0].message.content != first  # the weights loaded now answer
    finally:
        assert _admin(gateway, "unload", lora_name="lora-x").status_code == 200


def test_weights_written_over_an_adapter_s_directory_answer_as_themselves_once_loaded_again(
    gateway: str, adapters: dict[str, Path], tmp_path: Path
) -> None:
    """Unloaded, other weights written over its directory, loaded again under its name: the answer is the new
    weights', also from vLLM's prefix cache, which keys an adapter's KV blocks by its name and path (the prompt spans
    several blocks, and the response cache is skipped: what is checked is the engine's own reuse)."""
    folder = tmp_path / "rewritten"
    shutil.copytree(adapters["a"], folder)
    story = " ".join(f"Box {i} holds {i * 7 % 13} red marbles." for i in range(60))
    ask = {"messages": [{"role": "user", "content": story + " Which box holds the most?"}], "temperature": 0,
           "max_tokens": 12, "extra_headers": {"Cache-Control": "no-cache"}}
    sdk = client(gateway)
    assert _admin(gateway, "load", lora_name="lora-y", lora_path=str(folder)).status_code == 200
    try:
        first = sdk.chat.completions.create(model="lora-y", **ask).choices[0].message.content  # type: ignore[call-overload]
    finally:
        assert _admin(gateway, "unload", lora_name="lora-y").status_code == 200
    shutil.rmtree(folder)
    shutil.copytree(adapters["b"], folder)
    assert _admin(gateway, "load", lora_name="lora-y", lora_path=str(folder)).status_code == 200
    try:
        again = sdk.chat.completions.create(model="lora-y", **ask).choices[0].message.content  # type: ignore[call-overload]
    finally:
        assert _admin(gateway, "unload", lora_name="lora-y").status_code == 200
    fresh = sdk.chat.completions.create(model="lora-b", **ask).choices[0].message.content  # type: ignore[call-overload]
    assert again == fresh != first


def test_what_the_engine_cannot_load_is_a_400_naming_the_adapter(gateway: str, adapters: dict[str, Path]) -> None:
    """On the real engine, each refusal names the adapter and the object it is about, and leaves the engine serving."""
    folder = adapters["c"].parent
    ranked = write_adapter(folder / "rank-16", seed=5, rank=16)  # above the max_lora_rank its adapters gave the base
    (folder / "a-file").write_text("not an adapter")
    cases = [
        (str(ranked), f"has rank 16, above the max_lora_rank (8) of '{BASE}'"),
        (str(folder / ("x" * 300)), "is a name too long"),
        (str(folder / "a-file"), "is not a directory"),
        (str(folder / "a-file" / "x"), "does not exist"),
        (str(folder) + "/a\x00b", "is not a path"),
    ]
    for path, refusal in cases:
        refused = _admin(gateway, "load", lora_name="lora-bad", lora_path=path)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]
        assert error["param"] == "lora_path"
        assert error["message"].startswith("the adapter 'lora-bad'")
        assert refusal in error["message"], error
    assert "Paris" in (answer(gateway, BASE).choices[0].message.content or "")
