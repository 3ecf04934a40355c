"""The Responses API's routes: create (whole, streamed, or in the background), retrieve, delete,
list input items, cancel.

`POST /v1/responses` reads the `previous_response_id` chain from the store (404 when it is not
this key's), then hands the chat request that the `ResponsesService` made of it to the pipeline
(model choice, limits, cache, admission). A stream is framed with named events. A background
response is that same stream, played to nobody by a task that holds the admission permit until
it ends; a cancel hangs up on it (the engine request is aborted) and stores it as cancelled. It
counts as work in progress (`Lifecycle.hold`): a drain waits for it as for a request, and the
shutdown after the drain's timeout cancels what is still running.
Responses are scoped by API key, by its tenant (`anonymous` when keys are off).
"""

from __future__ import annotations

import asyncio
from typing import NoReturn

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from gateway.api.answers import json_response, respond, stream_response
from gateway.api.requests import context, parse, state_of
from gateway.api.sse import NAMED, EventStreamResponse
from gateway.errors import InvalidRequest, NotFound
from gateway.pipeline.answer import Stream
from gateway.pipeline.context import context_of
from gateway.pipeline.dispatch import dispatch
from gateway.pipeline.lifecycle import Lifecycle
from gateway.protocol.responses import InputItemsQuery, Item, ResponseDeleted, ResponseItemList, ResponsesRequest
from gateway.serving.responses import ResponsesService
from gateway.stores.responses import BackgroundRun, ResponseStore, StoredResponse

RUNNING = ("queued", "in_progress")


def _scope(request: Request) -> str:
    """The key's tenant: the same on every replica (its id in logs may not be: `tenancy.keys`)."""
    return context_of(request.scope).tenant


def _store(request: Request) -> ResponseStore:
    return state_of(request).responses


async def create(request: Request) -> Response:
    body = await parse(request, ResponsesRequest)
    state, scope = state_of(request), _scope(request)
    history = await _history(state.responses, scope, body.previous_response_id)
    service = ResponsesService(body, history, state.responses, scope)
    answer = await dispatch(context(request), state, service.chat_request(), service)
    if isinstance(answer, Stream):
        if body.background:
            return await _in_background(service, stream_response(answer, NAMED), state.responses, state.lifecycle)
        return stream_response(answer, NAMED)
    await service.save()
    return respond(answer)


async def _history(store: ResponseStore, scope: str, previous_id: str | None) -> list[Item]:
    """The conversation so far: the previous response's input items, then its output."""
    if previous_id is None:
        return []
    try:
        previous = await store.get(scope, previous_id)
    except NotFound:
        raise NotFound(f"Previous response with id '{previous_id}' not found.", "previous_response_id") from None
    if previous.response.status in RUNNING:  # its output is not all there yet: the history would lack it
        raise InvalidRequest(
            f"Previous response with id '{previous_id}' is still {previous.response.status}; "
            "continue from it once it has completed", "previous_response_id",
        )
    return [*previous.input_items, *previous.response.output]


async def _in_background(
    service: ResponsesService, stream: EventStreamResponse, store: ResponseStore, lifecycle: Lifecycle
) -> Response:
    accepted = service.skeleton("in_progress")
    await service.save(accepted)  # retrievable at once (the stream's own saves come later)
    hang_up = asyncio.Event()
    release = lifecycle.hold()  # a drain waits for it
    task = asyncio.create_task(_play(stream, hang_up))
    store.running[service.id] = BackgroundRun(task, hang_up, service.cancelled)

    def ended(_: object) -> None:
        store.running.pop(service.id, None)
        release()

    task.add_done_callback(ended)
    return json_response(accepted)


async def _play(stream: EventStreamResponse, hang_up: asyncio.Event) -> None:
    """Run a stream to its end with nobody listening; `hang_up` plays its client leaving."""

    async def receive() -> Message:
        await hang_up.wait()
        return {"type": "http.disconnect"}

    async def send(message: Message) -> None:
        pass

    await stream({"type": "http"}, receive, send)


async def by_id(request: Request) -> Response:
    """GET (retrieve) and DELETE /v1/responses/{response_id}."""
    store, scope, response_id = _store(request), _scope(request), request.path_params["response_id"]
    if request.method == "DELETE":
        await store.get(scope, response_id)  # another tenant's (or none): 404 before anything is touched
        run = store.running.get(response_id)
        if run is not None:
            await run.cancel()
        await store.delete(scope, response_id)
        return json_response(ResponseDeleted(id=response_id))
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        raise InvalidRequest("Streaming a stored response again is not supported here; retrieve it whole", "stream")
    return json_response((await store.get(scope, response_id)).response)


async def input_items(request: Request) -> Response:
    query = InputItemsQuery.model_validate(dict(request.query_params))
    stored = await _store(request).get(_scope(request), request.path_params["response_id"])
    items = stored.input_items if query.order == "asc" else stored.input_items[::-1]
    start = 0
    if query.after is not None:
        ids = [item.id for item in items]
        if query.after not in ids:
            raise InvalidRequest(f"No input item with id '{query.after}' in this response", "after")
        start = ids.index(query.after) + 1
    page = items[start : start + query.limit]
    return json_response(ResponseItemList(
        data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
        has_more=start + query.limit < len(items),
    ))


async def cancel(request: Request) -> Response:
    store, scope, response_id = _store(request), _scope(request), request.path_params["response_id"]
    stored = await store.get(scope, response_id)
    if not stored.response.background:
        _refuse_foreground()
    if stored.response.status not in RUNNING:
        return json_response(stored.response)  # done already: cancelling again changes nothing
    run = store.running.get(response_id)
    if run is not None:
        return json_response(await run.cancel())
    # running on another replica: it reads the cancel from the store and stops at its next check
    cancelled = stored.response.model_copy(update={"status": "cancelled"})
    await store.put(scope, StoredResponse(response=cancelled, input_items=stored.input_items))
    return json_response(cancelled)


def _refuse_foreground() -> NoReturn:
    raise InvalidRequest("Only responses created with background set to true can be cancelled", "response_id")
