"""The batch lane attacked as a hostile tenant and a careless client (issue 29): a batch's lines pass
every boundary a request to their route passes (who is asking, which models, guards, priority),
a batch runs only as an identity that still exists, and malformed input and races end in a clear
4xx or a batch that ends, never a 5xx or a batch that runs forever."""

from __future__ import annotations

import asyncio
import json
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from gateway.app import create_app
from gateway.stores.batchdb import SqliteRecords
from tests.fakes import FakeEngine, app_with, fake_settings
from tests.stores import answers, disk_batches, record
from tests.unit.test_batches import (
    _stored,
    by_custom_id,
    chat_line,
    jsonl,
    lines_of,
    on_disk,
    settings,
    submit,
    wait,
)
from tests.unit.test_reach import MODELS, REFERENCES, _engines
from tests.unit.test_responses import sdk_for
from tests.unit.test_tenants import keys_file
from tests.waits import until_sync

# --- which models: every way a line names a model, as the route ------------------------------------


def test_a_lines_model_reaches_only_what_the_key_may_use(tmp_path: Path) -> None:
    """The narrow key of test_reach: each reference a line of one batch; a denied model is the same
    404 line as a model that does not exist, and no engine it may not use runs."""
    engines = _engines()
    (tmp_path / "models.yaml").write_text(MODELS)
    keys = keys_file(tmp_path, "keys:\n  narrow: {key: sk-narrow, models: [small, assistant@1, vec]}\n")
    app = create_app(fake_settings(models_file=tmp_path / "models.yaml", keys_file=keys, **settings(tmp_path)),
                     engine_starter=lambda es: engines[es.served_model_name])
    with TestClient(app) as client:
        sdk = sdk_for(client, "sk-narrow")
        lines = [chat_line(f"{n}:{reference}", model=reference) for n, (reference, _) in enumerate(REFERENCES)]
        done = wait(sdk, submit(sdk, jsonl(*lines)).id)
        answers = by_custom_id(lines_of(sdk, done.output_file_id) + lines_of(sdk, done.error_file_id))
    unknown = answers[f"{len(REFERENCES) - 1}:ghost"]["response"]
    for n, (reference, reaches) in enumerate(REFERENCES):
        response = answers[f"{n}:{reference}"]["response"]
        if reaches is None:
            assert response["status_code"] == unknown["status_code"] == 404, reference
            error, expected = response["body"]["error"], unknown["body"]["error"]
            assert {**error, "message": ""} == {**expected, "message": ""}, reference
            assert error["message"] == expected["message"].replace("'ghost'", f"'{reference}'")
        else:
            assert response["status_code"] == 200, (reference, response)
            assert response["body"]["model"] == reaches, reference
    assert not engines["big"].requests
    assert not engines["assistant@2.0.0"].requests


# --- priority: a line stays in the batch lane ----------------------------------------------------

PRIORITY_KEYS = "keys:\n  boss: {key: sk-boss, priority: high, request_priority: true}\n"


def test_a_line_cannot_raise_itself_out_of_the_batch_lane(tmp_path: Path) -> None:
    engine = FakeEngine()
    with TestClient(app_with(engine, keys_file=keys_file(tmp_path, PRIORITY_KEYS), **settings(tmp_path))) as client:
        sdk = sdk_for(client, "sk-boss")  # a key that may raise its own requests: not its batch's lines
        lines = [chat_line("tier", service_tier="priority"), chat_line("int", priority=-5),
                 chat_line("both", service_tier="priority", priority=-100)]
        done = wait(sdk, submit(sdk, jsonl(*lines)).id)
        output = by_custom_id(lines_of(sdk, done.output_file_id))
    assert set(output) == {"tier", "int", "both"}
    assert [request.priority for request in engine.requests] == [2, 2, 2]
    assert {line["response"]["body"]["service_tier"] for line in output.values()} == {"flex"}


def _front(tmp_path: Path, upstream: str, keys: str) -> Any:
    models = tmp_path / "front-models.yaml"
    models.write_text(f"models:\n  - {{name: far, kind: remote, url: '{upstream}/v1', upstream_model: fake-model,"
                      " api_key: sk-up}\n")
    return app_with(models_file=models, keys_file=keys_file(tmp_path, keys), **settings(tmp_path))


@pytest.fixture
def upstream(tmp_path: Path) -> Iterator[tuple[str, FakeEngine]]:
    """A gateway whose key `sk-up` may choose its requests' priority: it runs what the front sends."""
    from tests.served import gateway

    engine = FakeEngine()
    keys = tmp_path / "up-keys.yaml"
    keys.write_text("keys:\n  front: {key: sk-up, request_priority: true}\n")
    with gateway(engine, keys_file=keys) as base:
        yield base, engine


def test_a_remote_model_gets_the_priority_decided_not_the_one_asked(tmp_path: Path, upstream: Any) -> None:
    """A key that may not raise its priority, and a batch's lines, do not raise it at a remote model
    either: what the front decided is what it forwards (service_tier, vLLM's priority)."""
    base, engine = upstream
    with TestClient(_front(tmp_path, base, "keys:\n  plain: {key: sk-plain}\n")) as client:
        asked = {"service_tier": "priority", "priority": -5}
        answer = client.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-plain"},
                             json={"model": "far", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2,
                                   **asked})
        assert answer.status_code == 200, answer.text
        assert engine.requests[-1].priority == 0  # the key's class: normal
        sdk = sdk_for(client, "sk-plain")
        done = wait(sdk, submit(sdk, jsonl(chat_line("x", model="far", **asked))).id)
        assert done.request_counts.completed == 1, lines_of(sdk, done.error_file_id)
    assert engine.requests[-1].priority == 2  # the batch lane's, not -5


# --- who is asking: a batch runs only as an identity that still exists ------------------------------


def test_an_anonymous_batch_does_not_spend_a_key_named_anonymous(tmp_path: Path) -> None:
    """A batch made with keys off, still pending when a keys file names a key `anonymous`: its lines
    are nobody's now (401), not that key's (its models, its budget)."""
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(chat_line("a")))
    batch_id = _stored(disk_batches(tmp_path / "batches"), source)  # owner: anonymous, keys off
    keys = keys_file(tmp_path, "keys:\n  anonymous: {key: sk-anon, budget: {day: 1000}}\n")
    engine = FakeEngine()
    with TestClient(app_with(engine, keys_file=keys, **settings(tmp_path))):
        assert on_disk(tmp_path, batch_id).status == "completed"
    assert engine.requests == []
    errors = answers(tmp_path / "batches", batch_id, ok=False)
    assert [line["response"]["status_code"] for line in errors] == [401]  # type: ignore[index]


def test_a_settings_key_removed_since_fails_its_batchs_lines(tmp_path: Path) -> None:
    engine = FakeEngine(delay=0.02)
    with TestClient(app_with(engine, api_keys=["sk-old"], **settings(tmp_path, max_in_flight=1))) as client:
        sdk = sdk_for(client, "sk-old")
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=4) for i in range(30))))
        wait(sdk, batch.id, ("in_progress",))
    ran = len(engine.requests)
    assert ran < 30
    with TestClient(app_with(engine, api_keys=["sk-new"], **settings(tmp_path))):
        done = on_disk(tmp_path, batch.id)
    assert done.status == "completed"
    assert len(engine.requests) == ran  # not one line more for a key that is gone
    assert done.request_counts.failed == 30 - done.request_counts.completed


def test_a_settings_keys_batch_runs_as_that_key_after_a_restart(tmp_path: Path) -> None:
    """Without `key_id_secret` each process names a key by an id of its own: a batch resumed by
    another process (a restart, another worker) runs as the key's id there (its limits, its guards)."""
    engine = FakeEngine(delay=0.02)
    with TestClient(app_with(engine, api_keys=["sk-k"], **settings(tmp_path, max_in_flight=1))) as client:
        sdk = sdk_for(client, "sk-k")
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=4) for i in range(30))))
        wait(sdk, batch.id, ("in_progress",))
    with TestClient(app_with(engine, api_keys=["sk-k"], **settings(tmp_path))) as client:
        done = wait(sdk_for(client, "sk-k"), batch.id)
    assert (done.status, done.request_counts.completed) == ("completed", 30)


# --- guards: a line passes the key's input and output guards, normalized ------------------------

GUARDS = """
profiles:
  strict:
    input:
      deny: ["(?i)project hydra"]
    output:
      deny: [{pattern: "(?i)confidential", action: redact, name: secret}]
"""


def test_a_lines_input_and_output_pass_the_keys_guards(tmp_path: Path) -> None:
    (tmp_path / "guards.yaml").write_text(textwrap.dedent(GUARDS))
    keys = keys_file(tmp_path, "keys:\n  guarded: {key: sk-g, guards: strict}\n  free: {key: sk-f}\n")
    engine = FakeEngine()
    engine.reply = ["the", " confidential", " plan"]
    app = app_with(engine, keys_file=keys, guards_file=tmp_path / "guards.yaml", **settings(tmp_path))
    disguised = "project\u200b \uff48\uff59\uff44\uff52\uff41"  # a zero-width space and fullwidth letters
    with TestClient(app) as client:
        direct = client.post("/v1/chat/completions", headers={"Authorization": "Bearer sk-g"},
                             json={"model": "fake-model", "messages": [{"role": "user", "content": disguised}]})
        sdk = sdk_for(client, "sk-g")
        done = wait(sdk, submit(sdk, jsonl(chat_line("blocked", disguised), chat_line("answered", "hello"))).id)
        answers = by_custom_id(lines_of(sdk, done.output_file_id) + lines_of(sdk, done.error_file_id))
        free = sdk_for(client, "sk-f")
        unguarded = wait(free, submit(free, jsonl(chat_line("answered", "hello"))).id)
        free_answer = lines_of(free, unguarded.output_file_id)[0]["response"]["body"]
    assert direct.status_code == answers["blocked"]["response"]["status_code"] == 400
    assert answers["blocked"]["response"]["body"]["error"]["code"] == direct.json()["error"]["code"]
    text = answers["answered"]["response"]["body"]["choices"][0]["message"]["content"]
    assert "confidential" not in text
    assert "confidential" in free_answer["choices"][0]["message"]["content"]


# --- logs: no prompt, output or key ------------------------------------------------------------


def test_a_batch_logs_no_prompt_output_or_key(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    import logging

    from gateway.telemetry.logs import configure

    configure("debug", "json")
    try:
        engine = FakeEngine()
        engine.reply = ["SECRET-OUTPUT-0815"]
        with TestClient(app_with(engine, api_keys=["sk-LEAK-4711"], **settings(tmp_path))) as client:
            sdk = sdk_for(client, "sk-LEAK-4711")
            lines = [chat_line("ok", "PRIVATE-PROMPT-1234"), chat_line("bad", "PRIVATE-PROMPT-1234", model="nope"),
                     chat_line("err", "PRIVATE-PROMPT-1234", max_tokens=-1)]
            done = wait(sdk, submit(sdk, jsonl(*lines)).id)
            assert done.request_counts.completed == 1
            out: list[str] = []

            def completed_logged() -> bool:  # logged just after the record that says so is written
                captured = capsys.readouterr()
                out.append(captured.out + captured.err)
                return "batch_completed" in "".join(out)

            until_sync(completed_logged, what="batch_completed logged")
    finally:
        logging.getLogger().handlers.clear()
    captured = capsys.readouterr()
    logged = "".join(out) + captured.out + captured.err
    for secret in ("PRIVATE-PROMPT-1234", "SECRET-OUTPUT-0815", "sk-LEAK-4711"):
        assert secret not in logged


# --- malformed files and requests: a clear 400 before anything is stored -------------------------

GOOD = json.dumps(chat_line("a")).encode()


@pytest.mark.parametrize(("content", "problem"), [
    (b"\xef\xbb\xbf" + GOOD + b"\n", "Line 1 of the batch file is not valid JSON"),
    (GOOD[:-2] + b'"\xff"}\n', "Line 1 of the batch file is not valid JSON"),
    (GOOD + b"\n\n" + GOOD.replace(b'"a"', b'"b"') + b"\n", "Line 2 of the batch file is empty"),
    (b"[1, 2]\n", "Line 1 of the batch file is not a JSON object"),
    (b'"just a string"\n', "Line 1 of the batch file is not a JSON object"),
    (GOOD.replace(b'"custom_id": "a"', b'"custom_id": 7') + b"\n", "has no 'custom_id'"),
    (GOOD.replace(b'"custom_id": "a"', b'"custom_id": "' + b"c" * (4 << 20) + b'"') + b"\n", "is longer than"),
    (GOOD + b"\n" + GOOD + b"\n", "repeats the custom_id 'a'"),
    (GOOD.replace(b'"POST"', b'"GET"') + b"\n", "must have 'method': 'POST'"),
    (GOOD.replace(b'"/v1/chat/completions"', b'"/v1/chat/completions/../../admin"') + b"\n", "unsupported 'url'"),
    (json.dumps({**chat_line("a"), "body": "text"}).encode() + b"\n", "has no 'body' object"),
    (json.dumps({**chat_line("a"), "body": [1]}).encode() + b"\n", "has no 'body' object"),
    (b'{"custom_id": "\\ud800", "method": "POST", "url": "/v1/chat/completions", "body": {}}\n', "not valid JSON"),
])
def test_a_malformed_batch_file_is_refused(tmp_path: Path, content: bytes, problem: str) -> None:
    with TestClient(app_with(FakeEngine(), **settings(tmp_path, ))) as client:
        answer = client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": "batch"},
                             headers={"authorization": "Bearer x"})
        assert answer.status_code == 400, answer.text
        assert problem in answer.json()["error"]["message"]
        assert answer.json()["error"]["param"] == "file"
        assert client.get("/v1/files").json()["data"] == []


def test_crlf_lines_and_a_missing_last_newline_are_a_good_file(tmp_path: Path) -> None:
    content = GOOD + b"\r\n" + GOOD.replace(b'"a"', b'"b"')
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        sdk = sdk_for(client)
        done = wait(sdk, submit(sdk, content).id)
        assert set(by_custom_id(lines_of(sdk, done.output_file_id))) == {"a", "b"}


def test_custom_ids_that_differ_only_by_normalization_are_two_lines(tmp_path: Path) -> None:
    """NFC and NFD spellings of one name are different strings, each answered once under its own."""
    nfc, nfd = "caf\u00e9", "cafe\u0301"
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        sdk = sdk_for(client)
        done = wait(sdk, submit(sdk, jsonl(chat_line(nfc), chat_line(nfd))).id)
        assert set(by_custom_id(lines_of(sdk, done.output_file_id))) == {nfc, nfd}


@pytest.mark.parametrize("metadata", [{"k": 1}, {"k": None}, {"k": ["v"]}, {"k": {"v": 1}}, "text", [["k", "v"]]])
def test_metadata_takes_only_strings(tmp_path: Path, metadata: Any) -> None:
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        made = sdk_for(client).files.create(file=("in.jsonl", jsonl(chat_line("a"))), purpose="batch")
        answer = client.post("/v1/batches", json={"input_file_id": made.id, "endpoint": "/v1/chat/completions",
                                                  "completion_window": "24h", "metadata": metadata})
        assert answer.status_code == 400, answer.text
        assert answer.json()["error"]["param"].startswith("metadata")


@pytest.mark.parametrize("batch_id", [
    "batch_" + "0" * 31 + "\u0660", "batch_%2e%2e", "batch_" + "0" * 4000, "batch_" + "0" * 32 + "%00", "%C0%AE%C0%AE",
    "batch_" + "\uff10" * 32,
])
def test_odd_batch_ids_are_404(tmp_path: Path, batch_id: str) -> None:
    with TestClient(app_with(FakeEngine(), **settings(tmp_path))) as client:
        for method, path in (("GET", f"/v1/batches/{batch_id}"), ("POST", f"/v1/batches/{batch_id}/cancel")):
            answer = client.request(method, path)
            assert answer.status_code == 404, (method, batch_id, answer.text)
            assert answer.json()["error"]["type"] == "invalid_request_error"


# --- another key's objects, everywhere --------------------------------------------------------


def test_a_foreign_after_lists_as_an_unknown_one(tmp_path: Path) -> None:
    with TestClient(app_with(FakeEngine(), api_keys=["sk-a", "sk-b"], **settings(tmp_path))) as client:
        mine = sdk_for(client, "sk-a")
        batch = submit(mine, jsonl(chat_line("a")))
        for query in (f"after={batch.id}", "after=batch_" + "0" * 32):
            answer = client.get(f"/v1/batches?{query}", headers={"authorization": "Bearer sk-b"})
            assert answer.status_code == 400
            assert answer.json()["error"]["param"] == "after"
        wait(mine, batch.id)


# --- races ------------------------------------------------------------------------------------


def test_cancel_twice_then_after_done(tmp_path: Path) -> None:
    with TestClient(app_with(FakeEngine(delay=0.05), **settings(tmp_path, max_in_flight=1))) as client:
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=8) for i in range(10))))
        first = sdk.batches.cancel(batch.id)
        assert first.status in ("cancelling", "cancelled")
        second = client.post(f"/v1/batches/{batch.id}/cancel")
        if second.status_code == 200:
            assert second.json()["status"] in ("cancelling", "cancelled")
            assert second.json()["cancelling_at"] == first.cancelling_at
        else:  # the runner had carried out the first already
            assert "status 'cancelled'" in second.json()["error"]["message"]
        done = wait(sdk, batch.id)
        assert done.status == "cancelled"
        with pytest.raises(openai.BadRequestError, match="status 'cancelled'"):
            sdk.batches.cancel(batch.id)


def test_a_batch_cancelled_while_validating_runs_no_line(tmp_path: Path) -> None:
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(*(chat_line(f"r{i}") for i in range(5))))
    store = disk_batches(tmp_path / "batches")
    batch_id = _stored(store, source)
    asyncio.run(store.of("anonymous").cancel(batch_id))  # asked before any runner looked at it
    engine = FakeEngine()
    with TestClient(app_with(engine, **settings(tmp_path))) as client:
        done = wait(sdk_for(client), batch_id)
    assert done.status == "cancelled"
    assert engine.requests == []


def test_deleting_the_input_or_the_output_file(tmp_path: Path) -> None:
    with TestClient(app_with(FakeEngine(delay=0.01), **settings(tmp_path))) as client:
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}") for i in range(5))))
        sdk.files.delete(batch.input_file_id)  # the batch holds its own link to the lines
        done = wait(sdk, batch.id)
        assert (done.status, done.request_counts.completed) == ("completed", 5)
        sdk.files.delete(done.output_file_id)
        with pytest.raises(openai.NotFoundError):
            sdk.files.content(done.output_file_id)
        assert sdk.batches.retrieve(batch.id).output_file_id == done.output_file_id  # still the batch's record


# --- a busy model pauses lines, whatever status it refuses with ---------------------------------


@pytest.mark.parametrize("reject_status", [429, 503])
def test_a_full_queue_pauses_lines_instead_of_failing_them(tmp_path: Path, reject_status: int) -> None:
    admission = {"max_running": 2, "max_waiting": 0, "reject_status": reject_status}  # 3 in flight: one refused a round
    from prometheus_client import REGISTRY

    def refused() -> float:
        return REGISTRY.get_sample_value("gateway_rejected_total", {"model": "fake-model", "reason": "queue_full"}) or 0.0

    engine = FakeEngine(delay=0.01)
    before = refused()
    with TestClient(app_with(engine, admission=admission, **settings(tmp_path, max_in_flight=3))) as client:
        sdk = sdk_for(client)
        # each line a tenth of a second: the three in flight overlap, however slowly they are sent
        done = wait(sdk, submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=10) for i in range(6)))).id)
        failed = lines_of(sdk, done.error_file_id)
    assert done.request_counts.model_dump() == {"total": 6, "completed": 6, "failed": 0}, failed
    assert refused() > before  # the queue was full: some line was refused and paused


def test_an_engine_that_cannot_serve_for_now_pauses_lines_instead_of_failing_them(tmp_path: Path) -> None:
    """Its 503 says when to retry (admission's `engine_unhealthy`): the lines run once it serves again."""
    from prometheus_client import REGISTRY

    def unhealthy() -> float:
        return REGISTRY.get_sample_value("gateway_rejected_total", {"model": "fake-model", "reason": "engine_unhealthy"}) or 0.0

    engine = FakeEngine()
    engine.dead = True
    before = unhealthy()
    with TestClient(app_with(engine, **settings(tmp_path))) as client:
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=4) for i in range(3))))
        until_sync(lambda: unhealthy() > before, what="a line refused by the dead engine")
        engine.dead = False
        done = wait(sdk, batch.id)
        failed = lines_of(sdk, done.error_file_id)
    assert done.request_counts.model_dump() == {"total": 3, "completed": 3, "failed": 0}, failed


# --- workers: one key, one id in every worker ---------------------------------------------------


def test_every_worker_names_a_key_by_the_same_id() -> None:
    """Without `key_id_secret` each process would draw its own: the workers' rate limits in Redis
    (`requests:<key id>`) would be one bucket per worker, each allowing the whole limit."""
    from gateway.server.workers import worker_settings
    from gateway.settings import Settings
    from gateway.tenancy.keys import authenticator_of
    from gateway.tenancy.tenants import Tenants

    parent = Settings(workers=2, api_keys=["sk-w"])
    shared = worker_settings(parent)
    ids = {authenticator_of(shared, Tenants(None)).keys.identify("sk-w") for _ in range(2)}
    assert len(ids) == 1
    assert worker_settings(shared) == shared  # a secret set is kept
    assert parent.key_id_secret is None  # the parent's own settings untouched


def test_a_lines_lora_adapter_is_reached_only_as_the_key_may(tmp_path: Path) -> None:
    """The adapters of test_adapters, each reference a line of the adapter-only and the base-only
    key's batches: what the base engine is asked for is what the route would ask for."""
    from tests.unit.test_adapters import REFERENCES as ADAPTER_REFERENCES
    from tests.unit.test_adapters import _starter, _write

    engines: dict[str, FakeEngine] = {}
    app = create_app(fake_settings(models_file=_write(tmp_path), keys_file=tmp_path / "keys.yaml", **settings(tmp_path)),
                     engine_starter=_starter(engines, {}))
    with TestClient(app) as client:
        for key, column in (("sk-adapter", 1), ("sk-base", 2)):
            sdk = sdk_for(client, key)
            lines = [chat_line(f"{n}:{ref[0]}", model=ref[0]) for n, ref in enumerate(ADAPTER_REFERENCES)]
            before = len(engines["base"].requests)
            done = wait(sdk, submit(sdk, jsonl(*lines)).id)
            answers = by_custom_id(lines_of(sdk, done.output_file_id) + lines_of(sdk, done.error_file_id))
            asked = {request.adapter or "base" for request in engines["base"].requests[before:]}
            granted = {ref[column] for ref in ADAPTER_REFERENCES} - {None}
            assert asked <= granted, (key, asked)
            for n, ref in enumerate(ADAPTER_REFERENCES):
                status = answers[f"{n}:{ref[0]}"]["response"]["status_code"]
                assert status == (404 if ref[column] is None else 200), (key, ref)


@pytest.mark.parametrize("batches", [True, False])
def test_the_parent_starts_the_engine_cores_the_workers_ask_for(tmp_path: Path, batches: bool) -> None:
    """`--workers 2`: each worker's app finds its model's shared core by its engine settings; the
    parent must start the cores with the scheduling the app resolves (batches on: priority, for the
    batch lane), else no worker starts, or the batch lane is fcfs in the engine."""
    from gateway.app import tenants_of
    from gateway.server.workers import WorkerPlan, gateway_worker, shared_engines

    config = fake_settings(workers=2, **{**settings(tmp_path), "batches": {**settings(tmp_path)["batches"],
                                                                           "enabled": batches}})
    cores = shared_engines(config, tenants_of(config))

    class Seat:
        def __init__(self, engine_settings: Any) -> None:
            self.settings = engine_settings

    asked: list[Any] = []

    def attach(seat: Seat) -> FakeEngine:
        asked.append(seat.settings)
        return FakeEngine()

    def serve(seat: Any, settings: Any, make_app: Any) -> int:
        with TestClient(make_app(None, tenants_of(settings))):
            return 0

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr("gateway.server.workers.attach_shared", attach)
        patch.setattr("gateway.server.workers.serve_worker", serve)
        assert gateway_worker(Seat(None), WorkerPlan(config, tuple(Seat(s) for s in cores.values()))) == 0
    assert [s.scheduling_policy for s in asked] == ["priority" if batches else "fcfs"]


def test_a_runner_that_lost_its_claim_writes_no_more_answers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Another replica claimed the batch once this one's claim had lapsed (this one stalled: its
    renewals did not land): the answers of the lines this one still had in flight are refused (the
    new holder runs those lines and answers them), and so is this one's record; it stops."""
    async def stalled(self: SqliteRecords, batch_id: str, token: int, ttl_s: float) -> bool:
        return True  # the renewal never lands: the claim runs out

    monkeypatch.setattr(SqliteRecords, "renew", stalled)
    engine = FakeEngine(delay=0.05)
    with TestClient(app_with(engine, **settings(tmp_path, max_in_flight=2, lease_s=1))) as client:
        sdk = sdk_for(client)
        batch = submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=6) for i in range(40))))
        until_sync(lambda: len(engine.running) >= 2, what="2 lines running")
        other = SqliteRecords(tmp_path / "batches" / "batches.sqlite3")  # another replica, on the same database
        until_sync(lambda: asyncio.run(other.claim(batch.id, "other", 60)), what="the batch claimed by another")
        taken, runs = len(answers(tmp_path / "batches", batch.id)), client.app_state["gateway"].batch_runner.runs
        until_sync(lambda: batch.id not in runs, what="the run stopped")  # at its first write refused: no line more
        assert len(answers(tmp_path / "batches", batch.id)) == taken  # the lines in flight here were not kept
        assert record(tmp_path / "batches", batch.id).batch.status == "in_progress"
        assert len(engine.requests) < 40


def _odd_upstream() -> Any:
    """A remote model that answers a 200 pretty-printed over several lines, and a 502 in HTML (a
    proxy's page), as upstreams do."""
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import Response
    from starlette.routing import Route

    async def chat(request: Request) -> Response:
        body = await request.json()
        content = body["messages"][-1]["content"]
        if content == "proxy":
            return Response("<html>\n<h1>502 Bad Gateway</h1>\n</html>\n", 502, media_type="text/html")
        if content == "refused":
            error = {"error": {"message": "no", "type": "invalid_request_error", "param": None, "code": None}}
            return Response(json.dumps(error, indent=2), 400, media_type="application/json")
        if content == "text":
            return Response("plain\ntext", media_type="text/plain")
        answer = {"id": "chatcmpl-x", "object": "chat.completion", "created": 0, "model": body["model"],
                  "choices": [{"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
                  "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2}}
        return Response(json.dumps(answer, indent=2), media_type="application/json")

    return Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])


def test_a_remote_models_odd_answers_are_one_json_line_each(tmp_path: Path) -> None:
    """Each answer is one line of the output file, its body JSON: a batch's files stay JSON Lines
    (a resume reads them back; a client parses them), whatever the upstream wrote."""
    from tests.served import served

    with served(_odd_upstream()) as base:
        models = tmp_path / "models.yaml"
        models.write_text(f"models:\n  - {{name: far, kind: remote, url: '{base}/v1', upstream_model: up}}\n")
        with TestClient(app_with(models_file=models, **settings(tmp_path))) as client:
            sdk = sdk_for(client)
            lines = [chat_line(content, content, model="far") for content in ("pretty", "proxy", "refused", "text")]
            done = wait(sdk, submit(sdk, jsonl(*lines)).id)
            written = [sdk.files.content(f).read().splitlines() for f in (done.output_file_id, done.error_file_id)]
    assert done.request_counts.model_dump() == {"total": 4, "completed": 1, "failed": 3}
    answers = by_custom_id([json.loads(line) for lines in written for line in lines])
    assert answers["pretty"]["response"]["body"]["choices"][0]["message"]["content"] == "ok"
    assert answers["proxy"]["response"]["status_code"] == 503  # as the route answers an upstream's 502
    assert answers["refused"]["response"]["status_code"] == 400
    assert answers["refused"]["response"]["body"]["error"]["message"] == "no"
    assert answers["text"]["response"]["status_code"] == 502
    assert answers["text"]["response"]["body"]["error"]["code"] == "bad_gateway"


def test_each_line_is_counted_and_charged_to_the_key(tmp_path: Path) -> None:
    """Per line, as per request: the key's tokens counted (its budget: test_batches)."""
    from tests.unit.test_remote_policies import metric

    keys = keys_file(tmp_path, "keys:\n  counted: {key: sk-c, team: t}\n")
    names = [f"gateway_key_{kind}_total" for kind in ("prompt_tokens", "completion_tokens")]
    before = [metric(name, key="counted", team="t") for name in names]
    with TestClient(app_with(FakeEngine(), keys_file=keys, **settings(tmp_path))) as client:
        sdk = sdk_for(client, "sk-c")
        done = wait(sdk, submit(sdk, jsonl(*(chat_line(f"r{i}", max_tokens=3) for i in range(3)))).id)
        after = [metric(name, key="counted", team="t") for name in names]
    assert done.request_counts.completed == 3
    assert [a - b for a, b in zip(after, before, strict=True)] == [done.usage.input_tokens, done.usage.output_tokens]
    assert done.usage.output_tokens == 9


def test_a_lines_fallback_hops_only_to_models_the_key_may_use(tmp_path: Path) -> None:
    """`small` falls back to `big`: with small's engine dead, the wide key's lines are answered by big;
    the narrow key's are not (big not granted): its batch pauses (the dead engine's 503 says when to
    retry) and its lines are answered by small once it serves again, not failed."""
    from prometheus_client import REGISTRY

    def refused() -> float:
        return REGISTRY.get_sample_value("gateway_rejected_total", {"model": "small", "reason": "engine_unhealthy"}) or 0.0

    engines = _engines()
    engines["small"].dead = True
    (tmp_path / "models.yaml").write_text(MODELS)
    keys = keys_file(tmp_path, "keys:\n  narrow: {key: sk-narrow, models: [small]}\n  wide: {key: sk-wide}\n")
    app = create_app(fake_settings(models_file=tmp_path / "models.yaml", keys_file=keys, **settings(tmp_path)),
                     engine_starter=lambda es: engines[es.served_model_name])
    lines = jsonl(chat_line("x", model="small"), chat_line("y", model="tiny"))
    with TestClient(app) as client:
        wide = sdk_for(client, "sk-wide")
        done = wait(wide, submit(wide, lines).id)
        assert sorted(line["response"]["status_code"] for line in lines_of(wide, done.output_file_id)) == [200, 200]
        by_big = len(engines["big"].requests)
        narrow = sdk_for(client, "sk-narrow")
        before = refused()
        batch = submit(narrow, lines)
        until_sync(lambda: refused() >= before + 2, what="the narrow key's lines refused by the dead engine")
        assert narrow.batches.retrieve(batch.id).request_counts.failed == 0
        assert len(engines["big"].requests) == by_big
        engines["small"].dead = False
        done = wait(narrow, batch.id)
        assert done.request_counts.model_dump() == {"total": 2, "completed": 2, "failed": 0}
        assert len(engines["big"].requests) == by_big


@pytest.mark.parametrize(("one", "other"), [("t", "t:x"), ("t", "t/"), ("t", "T"), ("anonymous", "keys-file:anonymous"),
                                            ("a/../b", "b"), ("", " ")])
def test_look_alike_owners_have_batches_of_their_own(tmp_path: Path, one: str, other: str) -> None:
    store = disk_batches(tmp_path / "batches")
    source = tmp_path / "in.jsonl"
    source.write_bytes(jsonl(chat_line("a")))
    batch_id = _stored(store, source, owner=one)
    assert asyncio.run(store.of(one).find(batch_id)).batch.id == batch_id
    with pytest.raises(Exception, match="No batch found"):
        asyncio.run(store.of(other).find(batch_id))


def test_a_bug_in_a_line_is_a_500_line_and_logged_with_its_traceback(tmp_path: Path) -> None:
    """As the route's exception handler does: the client sees a 500, the operator the traceback."""
    import structlog.testing

    engine = FakeEngine()
    engine.fail_after = 0  # a RuntimeError from inside the engine: no error of ours
    with TestClient(app_with(engine, **settings(tmp_path))) as client, structlog.testing.capture_logs() as logs:
        sdk = sdk_for(client, "unused")  # keys off: any bearer is anonymous
        done = wait(sdk, submit(sdk, jsonl(chat_line("boom", max_tokens=3))).id)
    assert done.request_counts.failed == 1
    failed = [entry for entry in logs if entry["event"] == "batch_line_failed"]
    assert len(failed) == 1
    assert failed[0]["error"] == "RuntimeError"
    assert failed[0]["exc_info"] is True
