"""The Batches API's routes: create, list, retrieve, cancel. The runner (`batches_runner`) runs a batch and writes
its status; these routes only read it and ask for a cancel."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.apis.batches.batches_wire import BatchCreate, BatchList, BatchListQuery
from gateway.errors import InvalidRequest
from gateway.pipeline.context import context_of
from gateway.protocol.openai import listing
from gateway.stores.batches import OwnedBatches
from gateway.web.answers import json_response
from gateway.web.requests import parse, state_of


def _mine(request: Request) -> OwnedBatches:
    return state_of(request).batches.of(context_of(request.scope).tenant)


async def create(request: Request) -> Response:
    body = await parse(request, BatchCreate)
    state, context = state_of(request), context_of(request.scope)
    # the input's content fixed from here: a delete meanwhile changes nothing
    found, content = await state.files.of(context.tenant).open(body.input_file_id)
    try:
        if found.purpose != "batch":
            raise InvalidRequest(f"The file '{body.input_file_id}' has purpose '{found.purpose}'; a batch's input must "
                                 "be a file of purpose 'batch'.", param="input_file_id")
        expires = body.output_expires_after.seconds if body.output_expires_after else state.settings.batches.output_expires_after_s
        stored = _mine(request).new(context.key_id, body.endpoint, expires, found.id, body.metadata)
        await _mine(request).create(stored, content.chunks)
    finally:
        await content.chunks.aclose()
    state.batch_runner.wake()
    return json_response(stored.batch)


async def list_batches(request: Request) -> Response:
    query = BatchListQuery.model_validate(dict(request.query_params))
    stored, more = await _mine(request).page(query.after, query.limit)
    page = [s.batch for s in stored]
    return json_response(listing(BatchList, page, more))


async def retrieve(request: Request) -> Response:
    return json_response((await _mine(request).find(request.path_params["batch_id"])).batch)


async def cancel(request: Request) -> Response:
    batch_id = request.path_params["batch_id"]
    cancelling = await _mine(request).cancel(batch_id)
    state_of(request).batch_runner.cancel(batch_id)
    return json_response(cancelling.batch)
