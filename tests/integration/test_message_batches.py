"""Anthropic's Message Batches on the real engine (the session's gateway) through the official
`anthropic` SDK (`client.messages.batches.create/retrieve/results/cancel/list/delete`): each result
compared with the same request made interactively at temperature 0; a cancel of a running batch
leaves its unrun requests `canceled`. That another key sees none of it: tests/unit/test_message_batch_attack.py."""

from __future__ import annotations

from typing import Any

import anthropic
import pytest

from tests.integration.conftest import MODEL
from tests.waits import until_sync

pytestmark = [pytest.mark.integration,
              pytest.mark.gateway_only("Message Batches run on the gateway's own engine")]
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Say hello.", "What is 2+2?"]


@pytest.fixture(scope="module")
def base(server: str) -> str:
    return server  # the session's gateway: its batch lane polls often (conftest)


def claude(base: str, key: str = "unused") -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=base, api_key=key, max_retries=0, timeout=120)


def params(question: str, max_tokens: int = 12) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "user", "content": question}]}


def ended(client: anthropic.Anthropic, batch_id: str, timeout: float = 150) -> Any:
    return until_sync(lambda: (found := client.messages.batches.retrieve(batch_id)).processing_status == "ended"
                      and found, timeout, f"batch {batch_id} ended", step_s=0.2)


def test_a_message_batch_answers_as_interactive_requests_do(base: str) -> None:
    with claude(base) as owner:
        requests = [{"custom_id": f"q{i}", "params": params(q)} for i, q in enumerate(QUESTIONS)]
        requests.append({"custom_id": "streamed", "params": {**params("hi"), "stream": True}})
        batch = owner.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        assert batch.id.startswith("msgbatch_")
        assert batch.processing_status == "in_progress"
        assert batch.request_counts.processing == 5
        done = ended(owner, batch.id)
        assert (done.request_counts.succeeded, done.request_counts.errored, done.request_counts.processing) == (4, 1, 0)
        assert done.results_url is not None
        assert done.ended_at is not None
        results = {line.custom_id: line.result for line in owner.messages.batches.results(batch.id)}
        assert set(results) == {*(f"q{i}" for i in range(len(QUESTIONS))), "streamed"}
        streamed = results["streamed"]
        assert streamed.type == "errored"
        assert streamed.error.error.type == "invalid_request_error"
        for i, question in enumerate(QUESTIONS):
            result = results[f"q{i}"]
            assert result.type == "succeeded", result
            asked = params(question)  # this SDK's create takes no temperature argument: sent as a body field
            interactive = owner.messages.create(model=MODEL, max_tokens=asked["max_tokens"], messages=asked["messages"],
                                                extra_body={"temperature": 0})
            assert result.message.content == interactive.content
            assert result.message.usage.input_tokens == interactive.usage.input_tokens
            assert result.message.stop_reason == interactive.stop_reason
        assert next(iter(owner.messages.batches.list(limit=10))).id == batch.id

        assert owner.messages.batches.delete(batch.id).id == batch.id
        with pytest.raises(anthropic.NotFoundError):
            owner.messages.batches.retrieve(batch.id)


def test_a_running_message_batch_is_canceled(base: str) -> None:
    with claude(base) as owner:
        requests = [{"custom_id": f"c{i}", "params": params(QUESTIONS[i % 4], 48)} for i in range(12)]
        batch = owner.messages.batches.create(requests=requests)  # type: ignore[arg-type]
        until_sync(lambda: owner.messages.batches.retrieve(batch.id).request_counts.succeeded >= 1, 60, "one answered",
                   step_s=0.1)
        canceling = owner.messages.batches.cancel(batch.id)
        assert canceling.processing_status in ("canceling", "ended")
        assert canceling.cancel_initiated_at is not None
        done = ended(owner, batch.id, timeout=60)
        counts = done.request_counts
        assert counts.canceled > 0
        assert counts.succeeded + counts.errored + counts.canceled == 12
        kinds = [line.result.type for line in owner.messages.batches.results(batch.id)]
        assert len(kinds) == 12
        assert kinds.count("canceled") == counts.canceled
        assert kinds.count("succeeded") == counts.succeeded
