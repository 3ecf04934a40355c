"""Mid-stream failover (`serving.continuation`, `pipeline.dispatch.onward`): a stream whose backend
fails after its first output goes on, on the next model of the fallback chain the key may reach,
which continues the text already sent. Every streaming API, embedded and remote backends (doubles
that fail after N tokens), the exact text, one role and one finish, the usage of both parts, the
key's reach, and the output guard across the seam."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog.testing
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind
from starlette.testclient import TestClient

from engine.errors import EngineUnavailable
from engine.types import ChoiceDelta, GenerationOutput, GenerationRequest, TokenLogprob
from gateway.apis.chat.chat_serving import CHAT
from gateway.app import create_app
from gateway.pipeline.answer import Stream
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import dispatch, resume
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
from gateway.telemetry import metrics
from tests.fakes import REPLY, FakeEngine, app_with, fake_settings
from tests.loopback_server import LoopbackServer
from tests.scripted_upstream import scripted
from tests.waits import until

MODELS = """
models:
  - {name: dying, fallback: [hidden, rescue]}
  - {name: hidden}
  - {name: rescue}
  - {name: dying-to-remote, fallback: [remote-rescue]}
  - {name: remote-rescue, kind: remote, url: UPSTREAM/v1}
  - {name: remote-dying, kind: remote, url: UPSTREAM/v1, fallback: [rescue]}
  - {name: alone}
  - {name: hopeless, fallback: [remote-refusing]}
  - {name: refused-then-rescued, fallback: [remote-refusing, rescue]}
  - {name: dying-strict, guards: strict, fallback: [rescue-lenient]}
  - {name: rescue-lenient, guards: lenient}
  - {name: mix, kind: split, versions: {dying-strict: 1}}
  - {name: remote-refusing, kind: remote, url: UPSTREAM/v1}
  - {name: plain-dying, fallback: [rescue-strict, rescue]}
  - {name: rescue-strict, guards: strict}
"""
KEYS = """
keys:
  guarded: {key: sk-guarded, guards: strict, models: [dying, rescue]}
  tenant: {key: sk-tenant, models: [dying, rescue, dying-to-remote, remote-rescue, remote-dying, alone, hopeless,
                                    remote-refusing, refused-then-rescued,
                                    dying-strict, rescue-lenient, mix, plain-dying, rescue-strict]}
"""
GUARDS = """
profiles:
  strict:
    output:
      deny: [{pattern: "brown fox", action: redact, name: fox}]
      holdback_chars: 16
  lenient:
    input:
      deny: [{pattern: "never said", action: redact, name: never}]
"""
AUTH = {"Authorization": "Bearer sk-tenant"}
QUESTION = [{"role": "user", "content": "hi"}]
DIES_AFTER = 3  # outputs a dying backend sends before it fails


def whole(tokens: int) -> str:
    """The uninterrupted answer of `tokens` tokens."""
    return "".join(REPLY[i % len(REPLY)] if i == 0 else " " + REPLY[i % len(REPLY)] for i in range(tokens))


WHOLE = whole(6)


class Dying(FakeEngine):
    """The fake engine, dead after DIES_AFTER outputs (as an engine core killed mid-stream)."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        count = 0
        async for output in super().generate(request):
            if count == DIES_AFTER:
                raise EngineUnavailable("the engine core died")
            count += 1
            yield output


def _offset(text: str) -> int:
    """How many words of REPLY the text already ends with (the partial answer it continues)."""
    words = text.split()
    return next((k for k in range(len(REPLY), 0, -1) if words[-k:] == REPLY[:k]), 0)


class Continuing(FakeEngine):
    """The fake engine, going on with REPLY where the partial answer in its prompt stops (what a
    model at temperature 0 does with `continue_final_message`)."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        self.requests.append(request)
        start = _offset(request.prompt_text or "")
        for step in range(request.sampling.max_tokens):
            last = step == request.sampling.max_tokens - 1
            word = REPLY[(start + step) % len(REPLY)]
            text = word if start + step == 0 else " " + word
            yield GenerationOutput(len(request.prompt_token_ids), [ChoiceDelta(0, text, [1000 + step], "length" if last else None)],
                                   finished=last)


def _chunk(text: str, finish: str | None = None, usage: dict[str, int] | None = None, chat: bool = True) -> bytes:
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    body: dict[str, Any] = {"id": "up", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1,
                            "model": "m", "choices": [{**choice, "finish_reason": finish}] if usage is None else []}
    if usage is not None:
        body["usage"] = usage
    return b"data: " + json.dumps(body).encode() + b"\n\n"


class Cut(httpx.AsyncByteStream):
    def __init__(self, chunks: list[bytes], broken: bool) -> None:
        self.chunks, self.broken = chunks, broken

    async def __aiter__(self) -> AsyncIterator[bytes]:
        for chunk in self.chunks:
            yield chunk
        if self.broken:
            raise httpx.ReadError("the upstream process died")


SEEN: list[dict[str, Any]] = []  # what the upstream was asked


def upstream(request: httpx.Request) -> httpx.Response:
    """A remote upstream: it continues a partial assistant turn (as vLLM's server and the gateway do)
    and dies after DIES_AFTER chunks of any other request; `remote-refusing` refuses to continue."""
    payload = json.loads(request.content)
    SEEN.append(payload)
    headers = {"content-type": "text/event-stream"}
    if payload["model"] == "remote-refusing":
        return httpx.Response(400, json={"error": {"message": "Extra inputs are not permitted: continue_final_message"}})
    chat = request.url.path.endswith("/chat/completions")
    if payload.get("continue_final_message") or (not chat and payload["prompt"].endswith("the quick brown")):
        assert not chat or payload["add_generation_prompt"] is False
        start = _offset(payload["messages"][-1]["content"] if chat else payload["prompt"])
        words = [" " + REPLY[start + i] for i in range(payload["max_tokens"])]
        chunks = [_chunk(w, "length" if i == len(words) - 1 else None, chat=chat) for i, w in enumerate(words)]
        usage = {"prompt_tokens": 20, "completion_tokens": len(words), "total_tokens": 20 + len(words)}
        chunks.append(_chunk("", usage=usage, chat=chat))
        return httpx.Response(200, headers=headers, stream=Cut([*chunks, b"data: [DONE]\n\n"], broken=False))
    words = [REPLY[0], *(" " + w for w in REPLY[1:DIES_AFTER])]
    return httpx.Response(200, headers=headers, stream=Cut([_chunk(w, chat=chat) for w in words], broken=True))


@pytest.fixture(scope="module")
def engines() -> dict[str, FakeEngine]:
    return {"dying": Dying("dying"), "hidden": FakeEngine("hidden"), "rescue": Continuing("rescue"),
            "dying-to-remote": Dying("dying-to-remote"), "alone": Dying("alone"), "hopeless": Dying("hopeless"),
            "refused-then-rescued": Dying("refused-then-rescued"), "dying-strict": Dying("dying-strict"),
            "rescue-lenient": Continuing("rescue-lenient"), "plain-dying": Dying("plain-dying"),
            "rescue-strict": Continuing("rescue-strict")}


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory, engines: dict[str, FakeEngine]) -> Iterator[TestClient]:
    folder = tmp_path_factory.mktemp("failover")
    with scripted(upstream) as base:
        (folder / "models.yaml").write_text(MODELS.replace("UPSTREAM", base))
        (folder / "keys.yaml").write_text(KEYS)
        (folder / "guards.yaml").write_text(GUARDS)
        settings = fake_settings(models_file=folder / "models.yaml", keys_file=folder / "keys.yaml",
                                 guards_file=folder / "guards.yaml")
        app = create_app(settings, engine_starter=lambda es: engines[es.served_model_name])
        with TestClient(app) as test_client:
            yield test_client


def events(answer: httpx.Response) -> list[dict[str, Any]]:
    assert answer.status_code == 200, answer.text
    return [json.loads(line[6:]) for line in answer.text.splitlines() if line.startswith("data: ") and line != "data: [DONE]"]


def chat(client: TestClient, model: str, **extra: Any) -> list[dict[str, Any]]:
    body = {"model": model, "messages": QUESTION, "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}, **extra}
    return events(client.post("/v1/chat/completions", json=body, headers=AUTH))


def chat_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])


@pytest.mark.parametrize("model", ["dying", "dying-to-remote", "remote-dying"])
def test_a_chat_stream_goes_on_on_the_fallback_with_nothing_repeated_or_missing(client, engines, model) -> None:
    before = metrics.STREAM_FAILOVERS.labels(model, "remote-rescue" if model == "dying-to-remote" else "rescue")._value.get()
    chunks = chat(client, model)
    assert chat_text(chunks) == WHOLE
    roles = [c for c in chunks if c["choices"] and "role" in c["choices"][0]["delta"]]
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert len(roles) == 1
    assert chunks.index(roles[0]) == 0
    assert finishes == ["length"]
    assert {c["id"] for c in chunks} == {chunks[0]["id"]}
    assert {c["model"] for c in chunks} == {chunks[0]["model"]}
    usage = chunks[-1]["usage"]
    assert usage["completion_tokens"] == 6  # both parts' output
    assert usage["total_tokens"] == usage["prompt_tokens"] + 6
    following = "remote-rescue" if model == "dying-to-remote" else "rescue"
    assert metrics.STREAM_FAILOVERS.labels(model, following)._value.get() == before + 1


def test_usage_counts_the_prompt_of_each_part(client, engines) -> None:
    chunks = chat(client, "dying")
    rescued = engines["rescue"].requests[-1]
    first = next(r for r in engines["dying"].requests[::-1])
    assert chunks[-1]["usage"]["prompt_tokens"] == len(first.prompt_token_ids) + len(rescued.prompt_token_ids)
    assert rescued.sampling.max_tokens == 6 - DIES_AFTER  # the rest of the budget


def test_the_fallback_continues_the_partial_turn(client, engines) -> None:
    chat(client, "dying")
    rescued = engines["rescue"].requests[-1]
    assert rescued.prompt_text is not None
    assert rescued.prompt_text.endswith("<assistant> the quick brown")
    SEEN.clear()
    chat(client, "dying-to-remote")
    asked = SEEN[-1]
    assert asked["messages"][-1] == {"role": "assistant", "content": "the quick brown"}
    assert asked["continue_final_message"] is True
    assert asked["add_generation_prompt"] is False
    assert asked["max_tokens"] == 6 - DIES_AFTER


def test_a_fallback_the_key_may_not_use_is_skipped(client, engines) -> None:
    hidden = len(engines["hidden"].requests)
    assert chat_text(chat(client, "dying")) == WHOLE
    assert len(engines["hidden"].requests) == hidden


def test_a_model_that_cannot_continue_is_passed_over_and_the_switch_is_logged(client) -> None:
    with structlog.testing.capture_logs() as logs:
        chunks = chat(client, "refused-then-rescued")
    assert chat_text(chunks) == WHOLE
    assert not [c for c in chunks if "error" in c]
    line = next(entry for entry in logs if entry["event"] == "request")
    assert line["failover"] == ["refused-then-rescued>rescue"]  # the one that refused never answered


def test_without_a_fallback_the_stream_ends_with_one_error_event(client) -> None:
    for model in ("alone", "hopeless"):  # no fallback; a fallback that refuses to continue
        body = {"model": model, "messages": QUESTION, "max_tokens": 6, "stream": True}
        answer = client.post("/v1/chat/completions", json=body, headers=AUTH)
        chunks = events(answer)
        assert [c for c in chunks if "error" in c] == [chunks[-1]]
        assert chat_text(chunks[:-1]) == "the quick brown"


@pytest.mark.parametrize("extra", [
    {"response_format": {"type": "json_object"}},
    {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]},
    {"n": 2},
])
def test_tool_calls_and_constrained_output_are_not_continued(client, extra) -> None:
    body = {"model": "dying", "messages": QUESTION, "max_tokens": 6, "stream": True, **extra}
    chunks = events(client.post("/v1/chat/completions", json=body, headers=AUTH))
    assert "error" in chunks[-1]


@pytest.mark.parametrize("model", ["dying", "dying-to-remote", "remote-dying"])
def test_a_completion_goes_on_by_appending_to_its_prompt(client, engines, model) -> None:
    body = {"model": model, "prompt": "Say: ", "max_tokens": 6, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    SEEN.clear()
    chunks = events(client.post("/v1/completions", json=body, headers=AUTH))
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == WHOLE
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")] == ["length"]
    assert len({c["id"] for c in chunks}) == 1
    if model == "dying-to-remote":
        assert SEEN[-1]["prompt"] == "Say: the quick brown"
    else:
        assert engines["rescue"].requests[-1].prompt_text == "Say: the quick brown"
    assert chunks[-1]["usage"]["completion_tokens"] == 6


def test_a_responses_stream_goes_on(client) -> None:
    body = {"model": "dying", "input": "hi", "max_output_tokens": 16, "temperature": 0, "stream": True}
    answer = client.post("/v1/responses", json=body, headers=AUTH)
    parsed = events(answer)
    deltas = "".join(e["delta"] for e in parsed if e["type"] == "response.output_text.delta")
    assert deltas == whole(16)
    done = [e for e in parsed if e["type"] in ("response.completed", "response.incomplete", "response.failed")]
    assert len(done) == 1
    assert done[0]["response"]["output"][0]["content"][0]["text"] == whole(16)
    assert done[0]["response"]["usage"]["output_tokens"] == 16
    assert [e["sequence_number"] for e in parsed] == list(range(len(parsed)))
    assert len({e["item_id"] for e in parsed if "item_id" in e}) == 1
    stored = client.get(f"/v1/responses/{done[0]['response']['id']}", headers=AUTH).json()
    assert stored["output"][0]["content"][0]["text"] == whole(16)  # what the client got


def test_a_messages_stream_goes_on(client) -> None:
    body = {"model": "dying", "messages": QUESTION, "max_tokens": 6, "temperature": 0, "stream": True}
    answer = client.post("/v1/messages", json=body, headers=AUTH)
    parsed = events(answer)
    text = "".join(e["delta"].get("text", "") for e in parsed if e["type"] == "content_block_delta")
    assert text == WHOLE
    assert [e["type"] for e in parsed].count("message_stop") == 1
    assert [e["type"] for e in parsed].count("content_block_start") == 1
    assert {e["index"] for e in parsed if e["type"].startswith("content_block")} == {0}
    assert next(e for e in parsed if e["type"] == "message_delta")["usage"]["output_tokens"] == 6


def test_continued_requests() -> None:
    """`continued`: the partial turn with its trailing whitespace held back (a template drops it), the
    rest of the budget; none for what cannot be continued soundly."""
    request = ChatCompletionRequest(model="m", messages=QUESTION, max_tokens=10, min_tokens=4)  # type: ignore[arg-type]
    continued = request.continued("Hello, wor ", 3)
    assert continued is not None
    body, held = continued
    assert held == " "
    assert body.messages[-1].content == "Hello, wor"
    assert body.max_tokens == 7
    assert body.min_tokens == 1
    assert body.continue_final_message
    assert not body.add_generation_prompt
    assert "continue_final_message" in body.model_dump(exclude_unset=True)
    again = body.continued("ld", 2)
    assert again is not None
    assert again[0].messages[-1].content == "Hello, world"
    assert len(again[0].messages) == 2
    assert CompletionRequest(model="m", prompt=[1, 2]).continued("x", 1) is None  # type: ignore[arg-type]
    prompt = CompletionRequest(model="m", prompt="a", echo=True).continued("b", 1)
    assert prompt is not None
    assert prompt[0].prompt == "ab"
    assert not prompt[0].echo
    assert prompt[0].max_tokens == 15


def test_our_chat_api_takes_continue_final_message(client, engines) -> None:
    body = {"model": "rescue", "messages": [*QUESTION, {"role": "assistant", "content": "the quick"}],
            "max_tokens": 2, "continue_final_message": True, "add_generation_prompt": False}
    answer = client.post("/v1/chat/completions", json=body, headers=AUTH)
    assert answer.json()["choices"][0]["message"]["content"] == " brown fox"
    assert engines["rescue"].requests[-1].prompt_text.endswith("<assistant> the quick")
    for wrong in ({"add_generation_prompt": True}, {"messages": QUESTION}):
        bad = client.post("/v1/chat/completions", json={**body, **wrong}, headers=AUTH)
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "continue_final_message"


def test_the_output_guard_sees_the_joined_answer_as_one_stream(client) -> None:
    """"brown" comes from the model that died, " fox" from the one that went on: the match spans the seam."""
    body = {"model": "dying", "messages": QUESTION, "max_tokens": 6, "temperature": 0, "stream": True}
    chunks = events(client.post("/v1/chat/completions", json=body, headers={"Authorization": "Bearer sk-guarded"}))
    text = chat_text(chunks)
    assert "brown fox" not in text
    assert text.startswith("the quick ")
    assert text.endswith(" jumps over")
    assert text == "the quick [FOX] jumps over"


async def test_resume_answers_on_from_the_text_so_far() -> None:
    """`dispatch.resume`: what a replica calls for a stream whose generation died with another one."""
    engine = Continuing("fake-model")
    app = app_with(engine)
    body = {"model": "fake-model", "messages": QUESTION, "max_tokens": 6, "stream": True}
    async with app.router.lifespan_context(app) as state:

        async def resumed(text: str, tokens: int, **extra: Any) -> list[dict[str, Any]]:
            request = ChatCompletionRequest.model_validate({**body, **extra})
            answer = await resume(RequestContext(), state["gateway"], request, CHAT, text, tokens)
            assert isinstance(answer, Stream)
            return [json.loads(chunk) async for chunk in answer.events]

        # the space held back at the seam is not sent twice; what is left of max_tokens, no more
        assert chat_text(await resumed("the quick brown ", 3)) == "fox jumps over"
        assert engine.requests[-1].prompt_text.endswith("<assistant> the quick brown")
        # a stop string begun before the seam ends the answer where it ends
        spanning = await resumed("the quick brown", 3, stop=["brown fox"])
        assert chat_text(spanning) == ""
        assert [c["choices"][0]["finish_reason"] for c in spanning if c["choices"]][-1] == "stop"


async def test_a_resumed_answers_output_guard_sees_the_text_sent_before(tmp_path: Path) -> None:
    """A stream taken over on another replica (`dispatch.resume`): "brown" was sent before the death, " fox" comes
    from the continuation; the guard reads across the seam as the one guard of an in-process failover does."""
    (tmp_path / "keys.yaml").write_text("keys:\n  guarded: {key: sk-guarded, guards: strict}\n")
    (tmp_path / "guards.yaml").write_text(GUARDS)
    (tmp_path / "models.yaml").write_text("models:\n  - {name: rescue}\n")
    settings = fake_settings(models_file=tmp_path / "models.yaml", keys_file=tmp_path / "keys.yaml",
                             guards_file=tmp_path / "guards.yaml")
    app = create_app(settings, engine_starter=lambda es: Continuing(es.served_model_name))
    body = ChatCompletionRequest.model_validate({"model": "rescue", "messages": QUESTION, "max_tokens": 6,
                                                 "stream": True, "temperature": 0})
    async with app.router.lifespan_context(app) as state:
        context = RequestContext(key_id="guarded")
        answer = await resume(context, state["gateway"], body, CHAT, "the quick brown", 3)
        assert isinstance(answer, Stream)
        text = chat_text([json.loads(chunk) async for chunk in answer.events])
    assert "fox" not in text
    assert context.record.guards == ["output:fox:redact"]


def test_the_output_guard_of_the_model_that_began_goes_on_and_is_logged(client) -> None:
    """Through a split (a name without a profile), the next model's profile is its own (its input
    checks on the continued request), the output guard still the one that began the answer: its
    redaction across the seam is in the access line."""
    with structlog.testing.capture_logs() as logs:
        chunks = chat(client, "mix")
    assert chat_text(chunks) == "the quick [FOX] jumps over"
    line = next(entry for entry in logs if entry["event"] == "request")
    assert line["failover"] == ["dying-strict>rescue-lenient"]
    assert "output:fox:redact" in line["guards"]


def test_the_trace_names_the_switch(tmp_path: Path) -> None:
    exporter = InMemorySpanExporter()
    (tmp_path / "models.yaml").write_text("models:\n  - {name: dying, fallback: [rescue]}\n  - {name: rescue}\n")
    engines = {"dying": Dying("dying"), "rescue": Continuing("rescue")}
    settings = fake_settings(models_file=tmp_path / "models.yaml", tracing={"otlp_endpoint": "http://collector.invalid/v1/traces"})
    app = create_app(settings, engine_starter=lambda es: engines[es.served_model_name], trace_exporter=exporter)
    with TestClient(app) as test_client:
        body = {"model": "dying", "messages": QUESTION, "max_tokens": 6, "stream": True}
        assert chat_text(events(test_client.post("/v1/chat/completions", json=body))) == WHOLE
    server = next(span for span in exporter.get_finished_spans() if span.kind is SpanKind.SERVER)
    switches = [dict(event.attributes or {}) for event in server.events if event.name == "gateway.failover"]
    assert switches == [{"gateway.failover.from": "dying", "gateway.failover.to": "rescue"}]


async def test_the_failed_models_permit_is_given_back_at_the_switch_and_the_next_ones_at_the_end(tmp_path: Path) -> None:
    (tmp_path / "models.yaml").write_text("models:\n  - {name: dying, fallback: [rescue]}\n  - {name: rescue}\n")
    engines = {"dying": Dying("dying"), "rescue": Continuing("rescue")}
    app = create_app(fake_settings(models_file=tmp_path / "models.yaml"), engine_starter=lambda es: engines[es.served_model_name])
    body = ChatCompletionRequest.model_validate({"model": "dying", "messages": QUESTION, "max_tokens": 6, "stream": True})
    async with app.router.lifespan_context(app) as state:
        gateway = state["gateway"]
        dying, rescue = (gateway.models.backends[name].admission for name in ("dying", "rescue"))
        answer = await dispatch(RequestContext(), gateway, body, CHAT)
        assert isinstance(answer, Stream)
        assert answer.on_close is not None
        chunks = [json.loads(await anext(answer.events)) for _ in range(DIES_AFTER + 1)]  # the first from the rescue
        assert chat_text(chunks).endswith(" fox")
        assert (dying.running, rescue.running) == (0, 1)  # the dead model's room back at once
        chunks += [json.loads(chunk) async for chunk in answer.events]
        answer.on_close()
        assert (dying.running, rescue.running) == (0, 0)
    assert chat_text(chunks) == WHOLE


def _pair(tmp_path: Path, engines: dict[str, FakeEngine] | None = None, **settings: Any) -> TestClient:
    """An app of `dying` with `rescue` its fallback (fresh engines unless given)."""
    (tmp_path / "models.yaml").write_text("models:\n  - {name: dying, fallback: [rescue]}\n  - {name: rescue}\n")
    engines = engines or {"dying": Dying("dying"), "rescue": Continuing("rescue")}
    app = create_app(fake_settings(models_file=tmp_path / "models.yaml", **settings),
                     engine_starter=lambda es: engines[es.served_model_name])
    return TestClient(app)


def test_the_joined_answer_keeps_the_first_models_output_bound_when_the_client_set_none(tmp_path: Path) -> None:
    """No max_tokens: the gateway's default bounds the whole answer, not each part (the next model
    would otherwise bring its whole default again)."""
    with _pair(tmp_path, default_max_tokens=5) as test_client:
        body = {"model": "dying", "messages": QUESTION, "stream": True, "stream_options": {"include_usage": True}}
        chunks = events(test_client.post("/v1/chat/completions", json=body))
    assert chat_text(chunks) == whole(5)
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")] == ["length"]


@pytest.mark.parametrize(("include", "expected"), [(True, "the quick brown fox"), (False, "the quick brown")])
@pytest.mark.parametrize("model", ["dying", "remote-dying"])
def test_a_stop_string_split_across_the_seam_still_stops(client, model, include, expected) -> None:
    """"brown" was sent before the switch, " fox" is the next model's: neither engine saw "brown fox"."""
    chunks = chat(client, model, stop=["brown fox"], include_stop_str_in_output=include)
    assert chat_text(chunks) == expected
    finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"] and c["choices"][0].get("finish_reason")]
    assert finishes == ["stop"]


async def test_a_client_gone_while_the_next_model_queues_leaves_no_permit_and_no_engine_request(tmp_path: Path) -> None:
    """The switch waits for room on the next model; the stream cancelled there (the client gone)
    leaves that queue, holds no permit on either model, and starts nothing on the next engine."""
    (tmp_path / "models.yaml").write_text("models:\n  - {name: dying, fallback: [rescue]}\n  - {name: rescue}\n")
    engines = {"dying": Dying("dying"), "rescue": Continuing("rescue")}
    settings = fake_settings(models_file=tmp_path / "models.yaml", admission={"max_running": 1, "adaptive": False})
    app = create_app(settings, engine_starter=lambda es: engines[es.served_model_name])
    body = ChatCompletionRequest.model_validate({"model": "dying", "messages": QUESTION, "max_tokens": 6, "stream": True})
    async with app.router.lifespan_context(app) as state:
        gateway = state["gateway"]
        dying, rescue = (gateway.models.backends[name].admission for name in ("dying", "rescue"))
        other = rescue.admit_now(1, "other")  # another request holds the next model's room
        assert other is not None
        answer = await dispatch(RequestContext(), gateway, body, CHAT)
        assert isinstance(answer, Stream)
        assert answer.on_close is not None
        [await anext(answer.events) for _ in range(DIES_AFTER)]
        switching = asyncio.ensure_future(anext(answer.events))
        await until(lambda: rescue.waiting, what="the switch queued for the next model")
        assert (dying.running, rescue.waiting) == (0, 1)
        switching.cancel()
        with pytest.raises(asyncio.CancelledError):
            await switching
        await answer.events.aclose()
        answer.on_close()
        assert (dying.running, rescue.running, rescue.waiting) == (0, 1, 0)  # only the other request's
        other.release()
        assert rescue.running == 0
    assert engines["rescue"].requests == []


def test_the_input_guard_reads_a_clients_partial_turn(client, engines) -> None:
    """A partial assistant turn the client sends is client text the model reads: checked as the rest."""
    body = {"model": "rescue-lenient", "messages": [*QUESTION, {"role": "assistant", "content": "I never said"}],
            "max_tokens": 2, "continue_final_message": True, "add_generation_prompt": False}
    assert client.post("/v1/chat/completions", json=body, headers=AUTH).status_code == 200
    prompt = engines["rescue-lenient"].requests[-1].prompt_text
    assert "never said" not in prompt
    assert prompt.endswith("<assistant> I [NEVER_1]")


async def test_a_client_gone_after_the_switch_aborts_the_next_models_engine_request(tmp_path: Path) -> None:
    (tmp_path / "models.yaml").write_text("models:\n  - {name: dying, fallback: [rescue]}\n  - {name: rescue}\n")
    engines = {"dying": Dying("dying"), "rescue": FakeEngine("rescue")}
    app = create_app(fake_settings(models_file=tmp_path / "models.yaml"), engine_starter=lambda es: engines[es.served_model_name])
    body = ChatCompletionRequest.model_validate({"model": "dying", "messages": QUESTION, "max_tokens": 6, "stream": True})
    async with app.router.lifespan_context(app) as state:
        answer = await dispatch(RequestContext(), state["gateway"], body, CHAT)
        assert isinstance(answer, Stream)
        [await anext(answer.events) for _ in range(DIES_AFTER + 1)]  # the last from the next model
        await answer.events.aclose()
    rescue = engines["rescue"]
    assert len(rescue.aborted) == 1
    assert list(rescue.aborted) == [r.request_id for r in rescue.requests]


@pytest.mark.parametrize(("path", "body"), [
    ("/v1/messages", {"messages": QUESTION, "max_tokens": 4}),
    ("/v1/responses", {"input": "hi"}),
])
@pytest.mark.parametrize("field", [{"continue_final_message": True}, {"add_generation_prompt": False}])
def test_the_continuation_fields_are_chats_only(client, path, body, field) -> None:
    """Messages and Responses have no such fields (a failover sets them on the chat request they become)."""
    answer = client.post(path, json={"model": "rescue", **body, **field}, headers=AUTH)
    assert answer.status_code == 400
    assert next(iter(field)) in answer.text


def test_a_model_whose_output_checks_the_answer_did_not_begin_under_is_passed_over(client, engines) -> None:
    """The answer's output guard is the one it began under (none here); the next model's profile
    checks its output: its text would go out unchecked, so the chain moves on past it."""
    with structlog.testing.capture_logs() as logs:
        chunks = chat(client, "plain-dying")
    assert chat_text(chunks) == WHOLE
    line = next(entry for entry in logs if entry["event"] == "request")
    assert line["failover"] == ["plain-dying>rescue"]
    assert engines["rescue-strict"].requests == []


def test_a_next_model_with_input_moderation_of_its_own_moderates_the_continued_request(tmp_path: Path) -> None:
    """Its profile's input checks are all run on the continued request (moderation too, which the
    first model's start runs), before it may continue: a flagged prompt passes it over."""
    server = LoopbackServer().start()
    try:
        (tmp_path / "models.yaml").write_text("models:\n  - {name: dying, fallback: [screened, rescue]}\n"
                                              "  - {name: screened, guards: screened}\n  - {name: rescue}\n")
        (tmp_path / "guards.yaml").write_text(f'moderation: {{url: "{server.url}"}}\n'
                                              "profiles:\n  screened: {input: {moderation: block}}\n")
        engines = {"dying": Dying("dying"), "screened": Continuing("screened"), "rescue": Continuing("rescue")}
        settings = fake_settings(models_file=tmp_path / "models.yaml", guards_file=tmp_path / "guards.yaml")
        app = create_app(settings, engine_starter=lambda es: engines[es.served_model_name])
        with TestClient(app) as test_client, structlog.testing.capture_logs() as logs:
            body = {"model": "dying", "messages": [{"role": "user", "content": "how to murder a bug"}],
                    "max_tokens": 6, "stream": True}
            assert chat_text(events(test_client.post("/v1/chat/completions", json=body))) == WHOLE
    finally:
        server.stop()
    assert engines["screened"].requests == []
    assert next(entry for entry in logs if entry["event"] == "request")["failover"] == ["dying>rescue"]
    assert any("murder" in text for text in server.inputs)


class LoggedContinuing(Continuing):
    """`Continuing`, with each token's logprob."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        async for output in super().generate(request):
            delta = output.choices[0]
            entry = TokenLogprob(delta.token_ids[0], delta.text, -0.5, 1, ())
            yield replace(output, choices=[replace(delta, logprobs=(entry,))])


def test_the_logprobs_of_text_held_back_at_the_seam_go_with_it(tmp_path: Path) -> None:
    """The partial ended in whitespace the next model's first token brings again: dropped from its
    text, and from its logprob's token (the tokens still spell the text)."""
    dying = Dying("dying")
    dying.reply = ["the", " quick", " brown ", " fox"]
    with _pair(tmp_path, {"dying": dying, "rescue": LoggedContinuing("rescue")}) as test_client:
        body = {"model": "dying", "messages": QUESTION, "max_tokens": 6, "stream": True, "logprobs": True}
        chunks = events(test_client.post("/v1/chat/completions", json=body))
    text = chat_text(chunks)
    assert text == "the quick brown fox jumps over"
    tokens = [entry["token"] for c in chunks if c["choices"] and c["choices"][0].get("logprobs")
              for entry in c["choices"][0]["logprobs"]["content"]]
    assert "".join(tokens) == text


def test_a_dead_engine_is_answered_by_its_healthy_fallback_and_skipped_as_a_hop(client, engines) -> None:
    """`Backend.healthy` in the one `admit`: a dead first model's request goes to its fallback at once; a
    dead next model is passed over mid-stream (no 503 inside a 200's stream: the stream ends as with no
    model left), its engine never asked."""
    rescue = engines["rescue"]
    body = {"model": "dying", "messages": QUESTION, "max_tokens": 6, "stream": True}
    engines["dying"].dead = True
    try:
        assert chat_text(chat(client, "dying")) == chat_text(events(client.post(
            "/v1/chat/completions", json={**body, "model": "rescue"}, headers=AUTH)))
    finally:
        engines["dying"].dead = False
    asked = len(rescue.requests)
    rescue.dead = True
    try:
        with structlog.testing.capture_logs() as logs:
            chunks = events(client.post("/v1/chat/completions", json=body, headers=AUTH))
    finally:
        rescue.dead = False
    assert [c for c in chunks if "error" in c] == [chunks[-1]]
    assert len(rescue.requests) == asked
    assert {"event": "failover_skipped", "model": "rescue", "error": "BackendUnavailable", "log_level": "info"} in logs


class DyingPastTheDeadline(Dying):
    """Dies as `Dying` does, but only once the request's deadline (`LATE_S` from its start) has passed."""

    async def generate(self, request: GenerationRequest) -> AsyncIterator[GenerationOutput]:
        loop, count = asyncio.get_running_loop(), 0
        passed = loop.time() + LATE_S + 0.05
        async for output in super().generate(request):
            count += 1
            if count == DIES_AFTER:
                await until(lambda: loop.time() > passed, what="the request's deadline passed")
            yield output


LATE_S = 0.3


def test_the_next_model_is_not_refused_for_a_deadline_that_passed_after_the_first_byte(tmp_path: Path) -> None:
    """The deadline is the first byte's (long sent at the switch): the next model's admission and answer are not
    bound by it."""
    engines: dict[str, FakeEngine] = {"dying": DyingPastTheDeadline("dying"), "rescue": Continuing("rescue")}
    body = {"model": "dying", "messages": QUESTION, "max_tokens": 6, "stream": True}
    with _pair(tmp_path, engines) as client:
        chunks = events(client.post("/v1/chat/completions", json=body, headers={"request-timeout": str(LATE_S)}))
    assert chat_text(chunks) == WHOLE
    assert not [c for c in chunks if "error" in c]
    assert len(engines["rescue"].requests) == 1
