"""Anthropic's Message Batches on the batch lane: a Message Batch is a batch of the Batches API
(`stores.batches`, run by `pipeline.batches`) whose lines go to `/v1/messages`, shown in Anthropic's
shapes. Here: the batch's input made from a create body (`input_lines`), the MessageBatch view of a
stored batch (`view`), and its results (`results`), one line per request, read from the batch's
output, error and input objects in the store (local files: `Blobs.local`, parsed in a worker thread).

How OpenAI's states and counts map to Anthropic's:
- `validating`, `in_progress`, `finalizing` → `in_progress`; `cancelling` → `canceling`; done → `ended`;
- request_counts: `succeeded` the lines answered 2xx, `errored` the others (a Messages error, in
  Anthropic's error shape), `expired` the lines a batch past its 24 h never ran, `canceled` those a
  cancel left unrun (once ended), `processing` the rest. The counts move as lines are answered,
  where Anthropic's stay at `processing` until the batch ends; they sum to the requests either way.
- results: available once the batch has ended, as Anthropic's; a line answered 2xx is `succeeded`
  (its Message), a line answered otherwise `errored` (its error), an expired one `expired`, and a
  request a cancel left unrun `canceled`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterator
from contextlib import AsyncExitStack
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from gateway.errors import InvalidRequest
from gateway.protocol.batches import DONE, StoredBatch
from gateway.protocol.message_batches import (
    MessageBatch,
    MessageBatchCreate,
    MessageBatchRequestCounts,
    ProcessingStatus,
)
from gateway.serving.batch_input import MESSAGES, read_lines
from gateway.stores.batches import ERRORS, INPUT, OUTPUT, BatchObjects

STATUSES: dict[str, ProcessingStatus] = {"cancelling": "canceling", **{status: "ended" for status in DONE}}


def input_lines(create: MessageBatchCreate, max_requests: int, max_line_bytes: int) -> bytes:
    """The batch's input file (`{"custom_id", "method", "url": "/v1/messages", "body"}` per line), or a
    400 naming the first request that is too large or repeats a custom_id."""
    if len(create.requests) > max_requests:
        raise InvalidRequest(f"requests: a batch has at most {max_requests} requests", param="requests")
    seen: set[str] = set()
    lines = []
    for i, request in enumerate(create.requests):
        if request.custom_id in seen:
            raise InvalidRequest(f"requests.{i}.custom_id: '{request.custom_id}' is not unique: each request of a "
                                 "batch needs a custom_id of its own", param=f"requests.{i}.custom_id")
        seen.add(request.custom_id)
        try:
            line = orjson.dumps({"custom_id": request.custom_id, "method": "POST", "url": MESSAGES,
                                 "body": request.params})
        except TypeError:  # an integer past 64 bits: no request takes one
            raise InvalidRequest(f"requests.{i}.params: an integer is out of range",
                                 param=f"requests.{i}.params") from None
        if len(line) > max_line_bytes:
            raise InvalidRequest(f"requests.{i}.params: larger than {max_line_bytes} bytes", param=f"requests.{i}.params")
        lines.append(line)
    return b"\n".join(lines) + b"\n"


def _time(seconds: int | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, tz=UTC)


def _counts(stored: StoredBatch, ended: bool) -> MessageBatchRequestCounts:
    batch = stored.batch
    total, succeeded, failed = batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed
    expired = stored.expired_lines
    unrun = max(0, total - succeeded - failed)
    if not ended:
        return MessageBatchRequestCounts(processing=unrun, succeeded=succeeded, errored=failed)
    if batch.status == "cancelled":
        return MessageBatchRequestCounts(succeeded=succeeded, errored=failed - expired, expired=expired, canceled=unrun)
    return MessageBatchRequestCounts(succeeded=succeeded, errored=failed - expired + unrun, expired=expired)


def view(stored: StoredBatch) -> MessageBatch:
    """The MessageBatch of a stored batch."""
    batch = stored.batch
    status = STATUSES.get(batch.status, "in_progress")
    ended = status == "ended"
    ended_at = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at
    return MessageBatch(
        id=batch.id, processing_status=status, request_counts=_counts(stored, ended),
        created_at=datetime.fromtimestamp(batch.created_at, tz=UTC),
        expires_at=datetime.fromtimestamp(batch.expires_at or batch.created_at, tz=UTC),
        ended_at=_time(ended_at) if ended else None, cancel_initiated_at=_time(batch.cancelling_at),
        results_url=results_path(batch.id) if ended else None,
    )


def results_path(batch_id: str) -> str:
    """Relative (the SDK joins it to its base URL): right behind a proxy that adds a path prefix."""
    return f"/v1/messages/batches/{batch_id}/results"


def _result(line: dict[str, Any], ok: bool) -> dict[str, Any]:
    response = line.get("response")
    if isinstance(response, dict):
        body = response.get("body")
        if ok:
            return {"type": "succeeded", "message": body}
        error = body if isinstance(body, dict) and body.get("type") == "error" else _error("api_error", str(body))
        return {"type": "errored", "error": {**error, "request_id": response.get("request_id")}}
    problem = line.get("error") or {}
    if problem.get("code") == "batch_expired":
        return {"type": "expired"}
    return {"type": "errored", "error": _error("api_error", str(problem.get("message", "The request failed.")))}


def _error(kind: str, message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": kind, "message": message}}


def _unrun(status: str) -> dict[str, Any]:
    if status == "cancelled":
        return {"type": "canceled"}
    return {"type": "errored", "error": _error("api_error", f"The request was not run: the batch ended {status}.")}


RESULT_LINES = 256  # result lines made per hop to the worker thread


async def results(batch: BatchObjects, stored: StoredBatch) -> AsyncIterator[bytes]:
    """The results of an ended batch, one JSON line per request (up to `RESULT_LINES` per chunk): those
    answered (in the order they were answered), then those never run. The store is read before this
    returns (its first chunk made): a store that fails is an error before the answer starts, never a
    200 whose body stops short."""
    chunks = _chunks(batch, stored)
    first = await anext(chunks, b"")
    return _after(first, chunks)


async def _after(first: bytes, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    try:
        if first:
            yield first
        async for chunk in chunks:
            yield chunk
    finally:
        closing = getattr(chunks, "aclose", None)
        if closing is not None:
            await closing()


async def _chunks(batch: BatchObjects, stored: StoredBatch) -> AsyncIterator[bytes]:
    async with AsyncExitStack() as stack:
        output, errors, requests = [await stack.enter_async_context(batch.local(part)) for part in (OUTPUT, ERRORS, INPUT)]
        if requests is None:
            raise RuntimeError(f"batch {batch.id} has no input")
        lines = _results(output, errors, requests, stored.batch.status)
        while chunk := await asyncio.to_thread(_take, lines):
            yield chunk


def _take(lines: Iterator[bytes]) -> bytes:
    return b"".join(line for _, line in zip(range(RESULT_LINES), lines, strict=False))


def _results(output: Path | None, errors: Path | None, requests: Path, status: str) -> Iterator[bytes]:
    """The result lines of these local files. Blocking reads: iterate it in a worker thread."""
    seen: set[str] = set()
    for path, ok in ((output, True), (errors, False)):
        if path is None:
            continue
        with path.open("rb") as lines:
            for raw in lines:
                line = orjson.loads(raw)
                seen.add(line["custom_id"])
                yield orjson.dumps({"custom_id": line["custom_id"], "result": _result(line, ok)}) + b"\n"
    for request in read_lines(requests):
        if request.custom_id not in seen:
            yield orjson.dumps({"custom_id": request.custom_id, "result": _unrun(status)}) + b"\n"
