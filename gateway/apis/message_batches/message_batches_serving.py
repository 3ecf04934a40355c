"""Anthropic's Message Batches on the batch lane: a Message Batch is a batch of the Batches API (`stores.batches`, run
by `apis.batches.batches_runner`) whose lines go to `/v1/messages`, shown in Anthropic's shapes (docs/api.md). Here:
its input made from a create body (`input_lines`), its MessageBatch view (`view`: OpenAI's states and counts mapped to
Anthropic's; the counts move as lines are answered, where Anthropic's stay at `processing` until the batch ends), and
its results (`results`), one line per request, read from its answers and its input."""

from __future__ import annotations

import asyncio
import contextlib
from pathlib import Path
from typing import Any

import orjson

from gateway.apis.batches.batches_input import MESSAGES
from gateway.apis.message_batches import message_batches_wire as wire
from gateway.errors import InvalidRequest
from gateway.protocol.batch_objects import DONE, StoredBatch
from gateway.stores.batchdb import Answer
from gateway.stores.batches import BatchStore, input_name, not_found
from gateway.stores.blobs import Opened, Staged

STATUSES: dict[str, wire.ProcessingStatus] = {"cancelling": "canceling", **{status: "ended" for status in DONE}}


def input_lines(create: wire.MessageBatchCreate, max_requests: int, max_line_bytes: int) -> bytes:
    """The batch's input file (`{"custom_id", "method", "url": "/v1/messages", "body"}` per line), or a
    400 naming the first request that is too large, repeats a custom_id or holds a number JSON has not."""
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
        # the body's parser takes NaN, Infinity and 1e400, a JSON line cannot keep them (orjson writes null): the
        # request would run with a value it did not ask for
        if orjson.loads(line)["body"] != request.params:
            raise InvalidRequest(f"requests.{i}.params: NaN and Infinity are not JSON numbers",
                                 param=f"requests.{i}.params")
        if len(line) > max_line_bytes:
            raise InvalidRequest(f"requests.{i}.params: larger than {max_line_bytes} bytes", param=f"requests.{i}.params")
        lines.append(line)
    return b"\n".join(lines) + b"\n"


def _counts(stored: StoredBatch, ended: bool) -> wire.MessageBatchRequestCounts:
    batch = stored.batch
    total, succeeded, failed = batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed
    expired = stored.expired_lines
    unrun = max(0, total - succeeded - failed)
    if not ended:
        return wire.MessageBatchRequestCounts(processing=unrun, succeeded=succeeded, errored=failed)
    if batch.status == "cancelled":
        return wire.MessageBatchRequestCounts(succeeded=succeeded, errored=failed - expired, expired=expired,
                                              canceled=unrun)
    return wire.MessageBatchRequestCounts(succeeded=succeeded, errored=failed - expired + unrun, expired=expired)


def view(stored: StoredBatch) -> wire.MessageBatch:
    """The MessageBatch of a stored batch."""
    batch = stored.batch
    status = STATUSES.get(batch.status, "in_progress")
    ended = status == "ended"
    ended_at = batch.completed_at or batch.cancelled_at or batch.expired_at or batch.failed_at
    return wire.MessageBatch(  # times as Unix seconds, made UTC datetimes by the model
        id=batch.id, processing_status=status, request_counts=_counts(stored, ended), created_at=batch.created_at,
        expires_at=batch.expires_at or batch.created_at, ended_at=ended_at if ended else None,
        cancel_initiated_at=batch.cancelling_at,
        # relative (the SDK joins it to its base URL): right behind a proxy that adds a path prefix
        results_url=f"/v1/messages/batches/{batch.id}/results" if ended else None,
    )


def _result(answer: Answer) -> dict[str, Any]:
    if answer.expired:
        return {"type": "expired"}
    response = orjson.loads(answer.line)["response"]  # the route's status, request id and body (`result_line`)
    if answer.ok:
        return {"type": "succeeded", "message": response["body"]}
    body = response["body"]
    error = body if isinstance(body, dict) and body.get("type") == "error" else _error(str(body))
    return {"type": "errored", "error": {**error, "request_id": response["request_id"]}}


def _error(message: str) -> dict[str, Any]:
    return {"type": "error", "error": {"type": "api_error", "message": message}}


def _line(custom_id: str, result: dict[str, Any]) -> bytes:
    return orjson.dumps({"custom_id": custom_id, "result": result}) + b"\n"


async def results(store: BatchStore, stored: StoredBatch, param: str) -> Opened:
    """The results of an ended batch, one JSON line per request: those answered (in the order they were answered),
    then those never run; each line made in a worker thread (a large batch stalls no other request), assembled in a
    local file opened before the answer starts (a delete of the batch meanwhile does not cut them short). A batch
    deleted before its input is read is a 404 naming `param`."""
    batch_id, status = stored.batch.id, stored.batch.status
    staged = await Staged.at(store.blobs.spool, "results")
    try:
        seen: set[str] = set()
        async for page in store.records.answers(batch_id):
            seen.update(answer.custom_id for answer in page)
            await staged.write(await asyncio.to_thread(_result_lines, page))
        async with store.blobs.local(input_name(batch_id)) as requests:
            unrun = None if requests is None else await asyncio.to_thread(_unrun_lines, requests, seen, status)
        if unrun is None:
            raise not_found(batch_id, param)
        await staged.write(unrun)
        await staged.close()
        return await Opened.of(staged.path)
    finally:
        await staged.discard()  # once open, its content stays readable until closed


def _result_lines(answers: list[Answer]) -> bytes:
    return b"".join(_line(answer.custom_id, _result(answer)) for answer in answers)


def _unrun_lines(requests: Path, seen: set[str], status: str) -> bytes | None:
    """None when the input is gone (its batch deleted since `local` found it)."""
    unrun = {"type": "canceled"} if status == "cancelled" else {
        "type": "errored", "error": _error(f"The request was not run: the batch ended {status}.")}
    with contextlib.suppress(FileNotFoundError), requests.open("rb") as asked:
        ids = (orjson.loads(raw)["custom_id"] for raw in asked)
        return b"".join(_line(i, unrun) for i in ids if i not in seen)
    return None
