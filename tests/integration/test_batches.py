"""The Batches API on the real engine through the official `openai` SDK: upload, create, poll to
`completed`, download the output and error files, each answer compared with the same request made
interactively at temperature 0; a second key sees none of it; a cancel of a running batch; and a
gateway killed (SIGKILL) mid-batch, restarted on the same directories, finishing the batch with
every custom_id answered exactly once."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import psutil
import pytest

from tests.integration.conftest import MODEL, gateway_process, in_front_of
from tests.stores import record
from tests.waits import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("the Batches API runs on the gateway's own engine")]
KEYS = ("sk-batch-owner", "sk-batch-other")
DONE = ("completed", "failed", "expired", "cancelled")
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Say hello.", "Count to three.", "What is 2+2?"]


def env_for(server: str, folder: Path) -> dict[str, str]:
    """A gateway in front of the session's (the batch lane is the gateway's: no engine of its own to start)."""
    return {
        **in_front_of(server, folder / "front"), "GATEWAY_API_KEYS": json.dumps(list(KEYS)),
        "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_WARMUP": "false", "GATEWAY_LOG_FORMAT": "json",
        "GATEWAY_FILES__DIR": str(folder / "files"), "GATEWAY_BATCHES__DIR": str(folder / "batches"),
        "GATEWAY_BATCHES__POLL_S": "0.2", "GATEWAY_BATCHES__LEASE_S": "6",  # a killed replica's claim lapses soon
    }


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batches")


def sdk(base: str, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def line(custom_id: str, question: str, model: str = MODEL, max_tokens: int = 8) -> dict[str, Any]:
    body = {"model": model, "messages": [{"role": "user", "content": question}], "temperature": 0,
            "max_tokens": max_tokens}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def submit(client: openai.OpenAI, lines: list[dict[str, Any]]) -> Any:
    content = b"".join(json.dumps(item).encode() + b"\n" for item in lines)
    made = client.files.create(file=("requests.jsonl", content), purpose="batch")
    return client.batches.create(input_file_id=made.id, endpoint="/v1/chat/completions", completion_window="24h")


def wait(client: openai.OpenAI, batch_id: str, until: Any = lambda b: b.status in DONE, timeout: float = 150) -> Any:
    return until_sync(lambda: until(found := client.batches.retrieve(batch_id)) and found, timeout,
                      f"batch {batch_id} as awaited", step_s=0.2)


def lines_of(client: openai.OpenAI, file_id: str | None) -> dict[str, dict[str, Any]]:
    if file_id is None:
        return {}
    lines = [json.loads(raw) for raw in client.files.content(file_id).read().splitlines()]
    found = {item["custom_id"]: item for item in lines}
    assert len(found) == len(lines), "a custom_id answered twice"
    return found


@pytest.fixture(scope="module")
def first(server: str, folder: Path) -> Iterator[tuple[str, Any]]:
    with gateway_process(folder, env_for(server, folder)) as started:
        yield started


def test_a_batch_answers_as_interactive_requests_do(first: tuple[str, Any]) -> None:
    owner = sdk(first[0])
    lines = [line(f"q{i}", q) for i, q in enumerate(QUESTIONS)] + [line("nope", "hi", model="no-such-model")]
    batch = submit(owner, lines)
    assert batch.status == "validating"
    done = wait(owner, batch.id)
    assert done.status == "completed"
    assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (6, 5, 1)
    output, errors = lines_of(owner, done.output_file_id), lines_of(owner, done.error_file_id)
    assert set(errors) == {"nope"}
    assert errors["nope"]["response"]["status_code"] == 404
    assert errors["nope"]["response"]["body"]["error"]["code"] == "model_not_found"
    for i, question in enumerate(QUESTIONS):
        answered = output[f"q{i}"]["response"]
        assert answered["status_code"] == 200
        interactive = owner.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": question}],
                                                    temperature=0, max_tokens=8)
        assert answered["body"]["choices"][0]["message"]["content"] == interactive.choices[0].message.content
        assert answered["body"]["usage"]["prompt_tokens"] == interactive.usage.prompt_tokens
    assert done.usage.input_tokens == sum(o["response"]["body"]["usage"]["prompt_tokens"] for o in output.values())

    other = sdk(first[0], KEYS[1])  # a second key sees none of it
    assert list(other.batches.list()) == []
    assert list(other.files.list()) == []
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.files.content(done.output_file_id)


def test_a_running_batch_is_cancelled(first: tuple[str, Any]) -> None:
    owner = sdk(first[0])
    batch = submit(owner, [line(f"c{i}", f"{QUESTIONS[i % 5]} (question {i} of a batch cancelled)", max_tokens=48)
                           for i in range(12)])  # questions of their own: none answered from the upstream's cache
    wait(owner, batch.id, lambda b: b.status == "in_progress", timeout=60)
    cancelling = owner.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled")
    done = wait(owner, batch.id, timeout=60)
    assert done.status == "cancelled"
    assert done.request_counts.completed < 12
    assert len(lines_of(owner, done.output_file_id)) == done.request_counts.completed


def kill(process: Any) -> None:
    """SIGKILL the gateway and its engine processes: no drain, no shutdown code runs."""
    family = psutil.Process(process.pid).children(recursive=True)
    process.kill()
    for child in family:
        child.kill()
    process.wait(timeout=30)


def test_a_killed_gateway_resumes_its_batch_after_a_restart(first: tuple[str, Any], folder: Path, server: str) -> None:
    base, process = first
    # questions of their own: no answer from the upstream's cache, so the kill comes mid-batch
    lines = [line(f"k{i}", f"{QUESTIONS[i % 5]} (question {i} of a batch cut short)", max_tokens=32) for i in range(20)]
    batch = submit(sdk(base), lines)
    wait(sdk(base), batch.id, lambda b: b.request_counts.completed >= 4, timeout=120)
    kill(process)
    killed = record(folder / "batches", batch.id)  # as the killed gateway left it in its database
    assert killed.batch.status == "in_progress"
    assert killed.batch.request_counts.completed < 20  # killed mid-batch
    with gateway_process(folder, env_for(server, folder)) as (again, _):
        owner = sdk(again)
        done = wait(owner, batch.id)
        output = lines_of(owner, done.output_file_id)  # (each custom_id once: checked there)
    assert done.status == "completed"
    assert set(output) == {f"k{i}" for i in range(20)}
    assert (done.request_counts.completed, done.request_counts.failed) == (20, 0)
