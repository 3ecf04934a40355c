"""The Responses API's routes: create (whole, streamed, or in the background), retrieve, delete, list
input items, cancel. Responses are the asking key's tenant's, reached only through the store's view
of that owner (`stores.responses`). A background response is the same stream played to nobody by a
task that holds the admission permit until it ends and counts as work in progress for the drain
(`Lifecycle.hold`); a cancel hangs up on it and stores it as cancelled.
"""

from __future__ import annotations

import asyncio
import dataclasses

from starlette.requests import Request
from starlette.responses import Response
from starlette.types import Message

from gateway.apis.conversations.conversations_serving import Conversations, joined
from gateway.apis.responses import responses_mcp
from gateway.apis.responses.responses_serving import ResponsesService, history_of
from gateway.apis.responses.responses_wire import InputItemsQuery, ResponseDeleted, ResponsesRequest, item_page
from gateway.errors import InvalidRequest, NotFound
from gateway.pipeline.answer import Stream
from gateway.pipeline.context import context_of
from gateway.pipeline.dispatch import dispatch
from gateway.pipeline.lifecycle import Lifecycle
from gateway.protocol.sse_wire import NAMED
from gateway.stores.responses import BackgroundRun, OwnedResponses, not_found
from gateway.web.answers import json_response, respond, stream_response
from gateway.web.requests import context, parse, state_of
from gateway.web.sse import EventStreamResponse, after_of, resumable_of, resumed


def _mine(request: Request) -> OwnedResponses:
    """The asking key's stored responses: its tenant's, the same on every replica (its id in logs
    may not be: `tenancy.keys`)."""
    return state_of(request).responses.of(context_of(request.scope).tenant)


async def create(request: Request) -> Response:
    body = await parse(request, ResponsesRequest)
    state, mine = state_of(request), _mine(request)
    turn = await joined(Conversations(mine, state.settings.max_body_bytes), body)  # its `conversation`, if it names one
    history = turn.items if turn else await history_of(mine, body.previous_response_id)
    if turn:  # a large conversation is prepared off the event loop, as a large body is
        context_of(request.scope).body_bytes += turn.size
    if responses_mcp.applies(body):  # the gateway runs the tools: a response of several model turns
        return respond(await responses_mcp.answer(context(request), state, body, mine, history, turn), NAMED)
    service = ResponsesService(body, history, mine, turn)
    answer = await dispatch(context(request), state, service.chat_request(), service)
    if isinstance(answer, Stream):
        stream = stream_response(answer, NAMED, stream_id=service.id)  # resumed by the response's id
        resumable = resumable_of(request.scope)
        if body.background:  # played to nobody, still resumable; a cancel (its client's leaving) stops it at once
            stream.resumable = None if resumable is None else dataclasses.replace(resumable, grace_s=0.0)
            return await _in_background(service, stream, state.lifecycle)
        if resumable is not None and not body.store:
            # not stored: once it ends it is an unknown response (OpenAI's), its events kept only for a client that
            # lost its connection to read the rest, as long as a departed client's stream waits for it
            kept = max(resumable.grace_s, state.settings.streams.lease_s)  # a reconnect after a blip, also with no grace
            stream.resumable = dataclasses.replace(resumable, takeover=dataclasses.replace(resumable.takeover,
                                                                                            ttl_s=kept))
        return stream
    await service.save()
    return respond(answer)


async def _in_background(service: ResponsesService, stream: EventStreamResponse, lifecycle: Lifecycle) -> Response:
    accepted = service.skeleton("in_progress")
    await service.save(accepted)  # retrievable at once (the stream's own saves come later)
    hang_up = asyncio.Event()
    release = lifecycle.hold()  # a drain waits for it
    task = asyncio.create_task(_play(stream, hang_up))
    service.mine.track(service.id, BackgroundRun(task, hang_up, service.cancelled))
    task.add_done_callback(lambda _: release())
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
    mine, response_id = _mine(request), request.path_params["response_id"]
    if request.method == "DELETE":
        await mine.delete(response_id)
        await state_of(request).streams.of(context_of(request.scope).tenant).forget(response_id)  # nor streamed again
        return json_response(ResponseDeleted(id=response_id))
    if request.query_params.get("stream", "false").lower() not in ("false", "0"):
        return await _streamed(request, mine, response_id)
    return json_response((await mine.get(response_id)).response)


async def _streamed(request: Request, mine: OwnedResponses, response_id: str) -> Response:
    """`?stream=true&starting_after=N` (or `Last-Event-ID: N`): the response's events after sequence number N (all
    without it), from any replica, while its log is kept (`stores.streams`); a stored response whose events are gone is a 400."""
    param, value = "starting_after", request.query_params.get("starting_after")
    if value is None:  # an EventSource reconnecting says where it was this way
        param, value = "Last-Event-ID", request.headers.get("last-event-id")
    after = after_of(value, param)
    try:
        return await resumed(request.scope, response_id, after, "/v1/responses", not_found, param, NAMED)
    except NotFound:
        await mine.get(response_id)  # none of this key's: the 404 of an unknown id
    raise InvalidRequest("This response's events are no longer kept (or it was not streamed); retrieve it whole",
                         "stream")


async def input_items(request: Request) -> Response:
    query = InputItemsQuery.model_validate(dict(request.query_params))
    stored = await _mine(request).get(request.path_params["response_id"])
    return json_response(item_page(stored.input_items, query, "this response's input"))


async def cancel(request: Request) -> Response:
    return json_response(await _mine(request).cancel(request.path_params["response_id"]))
