"""Anthropic's Message Batches routes: create, list, retrieve, cancel, delete, results. A Message Batch is a batch of
the Batches API under an id of its own kind (`msgbatch_`), its requests kept among the batch's objects; the create
body is read in memory (bounded by `max_body_bytes`)."""

from __future__ import annotations

import asyncio

from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.apis.batches.batches_input import MESSAGES
from gateway.apis.message_batches import message_batches_serving as mb
from gateway.apis.message_batches import message_batches_wire as wire
from gateway.errors import InvalidRequest
from gateway.pipeline.context import context_of
from gateway.protocol.openai import listing
from gateway.stores.batches import MESSAGE_BATCH, OwnedBatches
from gateway.web.answers import json_response
from gateway.web.requests import parse, state_of

PARAM = "message_batch_id"


def _mine(request: Request) -> OwnedBatches:
    return state_of(request).batches.of(context_of(request.scope).tenant, MESSAGE_BATCH)


async def create(request: Request) -> Response:
    body = await parse(request, wire.MessageBatchCreate)
    state, context = state_of(request), context_of(request.scope)
    files = state.settings.files
    content = await asyncio.to_thread(mb.input_lines, body, files.max_lines, files.max_line_bytes)
    mine = _mine(request)
    stored = mine.new(context.key_id, MESSAGES, state.settings.batches.output_expires_after_s, total=len(body.requests))
    await mine.create(stored, content)
    state.batch_runner.wake()
    return json_response(mb.view(stored))


async def list_batches(request: Request) -> Response:
    query = wire.MessageBatchListQuery.model_validate(dict(request.query_params))
    if query.before_id is not None and query.after_id is not None:
        raise InvalidRequest("Give before_id or after_id, not both", param="before_id")
    page, more = await _mine(request).page(query.after_id, query.limit, query.before_id, ("after_id", "before_id"))
    return json_response(listing(wire.MessageBatchList, [mb.view(stored) for stored in page], more))


async def retrieve(request: Request) -> Response:
    return json_response(mb.view(await _mine(request).find(request.path_params[PARAM], PARAM)))


async def delete(request: Request) -> Response:
    batch_id = request.path_params[PARAM]
    await _mine(request).delete(batch_id, PARAM)
    return json_response(wire.DeletedMessageBatch(id=batch_id))


async def cancel(request: Request) -> Response:
    batch_id = request.path_params[PARAM]
    ended = f"Batch '{batch_id}' has already ended: only a batch still in progress can be canceled."
    cancelling = await _mine(request).cancel(batch_id, PARAM, ended)
    state_of(request).batch_runner.cancel(batch_id)
    return json_response(mb.view(cancelling))


async def results(request: Request) -> Response:
    batch_id = request.path_params[PARAM]
    stored = await _mine(request).find(batch_id, PARAM)
    if mb.view(stored).processing_status != "ended":
        raise InvalidRequest(f"Batch '{batch_id}' has not ended yet: its results are available once it has.",
                             param=PARAM)
    lines = await mb.results(state_of(request).batches, stored, PARAM)
    return StreamingResponse(lines.chunks, media_type="application/x-jsonl", background=BackgroundTask(lines.chunks.aclose))
