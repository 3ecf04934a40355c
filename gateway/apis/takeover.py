"""A resumable stream taken over on this replica when the one producing it died (`StreamStore.continuation`,
docs/streams.md "a dead replica"): the key that asked found again (`Authenticator.reidentify`, as a batch's lines
are), its request parsed again for the API at its path, the text already sent read out of the events produced, and
the answer continued from there on the one pipeline (`dispatch.resume`: the key's reach, guards, limits, admission,
fallbacks). Its events carry the first stream's ids (chat's and completions' `id`, `created`, `model`; Messages'
text block index; a Responses stream's response, its message and the next `sequence_number`), so the client sees
one stream. Chat Completions, Completions, Messages and Responses (a message's text) are continued.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator, Callable
from typing import Any

import orjson
import structlog
from pydantic import ValidationError

from gateway.apis.chat.chat_serving import CHAT
from gateway.apis.completions.completions_serving import COMPLETIONS
from gateway.apis.conversations.conversations_serving import Conversations, joined
from gateway.apis.messages.messages_serving import MESSAGES, to_chat
from gateway.apis.messages.messages_wire import MessagesRequest
from gateway.apis.responses import responses_mcp
from gateway.apis.responses.responses_serving import ResponsesService, history_of
from gateway.apis.responses.responses_wire import ResponseEvents, ResponsesRequest
from gateway.errors import AuthenticationFailed, ServiceUnavailable, invalid_body
from gateway.pipeline.answer import Stream, json_bytes
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import resume
from gateway.pipeline.state import GatewayState
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
from gateway.protocol.response_objects import OutputMessage, Response
from gateway.protocol.sse_wire import FRAMINGS, NAMED, Framing, error_frame, payloads
from gateway.serving.service import Service
from gateway.stores.streams import Continuation, Takeover
from gateway.telemetry.record import close_record, open_record
from gateway.tenancy.keys import Identity
from gateway.web.error_render import from_exception

log = structlog.get_logger(__name__)


class _Api:
    """A stream's API, as a takeover continues it (OpenAI's chunks: chat's and completions'): its request, its
    service, the text of an event already sent, and a continued event as the first stream's (None: left out)."""

    framing = FRAMINGS["openai"]

    def __init__(self, request: type[Any], service: Service[Any, Any, Any], text: Callable[[dict[str, Any]], Any],
                 to_chat: Callable[[Any], Any] | None = None) -> None:
        self.request, self.service, self._text, self.to_chat = request, service, text, to_chat

    def text(self, event: dict[str, Any]) -> str:
        choices = event.get("choices") or [{}]
        text = self._text(choices[0])
        return text if isinstance(text, str) else ""

    async def continuing(self, state: GatewayState, context: RequestContext, body: Any, events: list[dict[str, Any]],
                         text: str) -> tuple[Any, Service[Any, Any, Any]]:
        """The request `dispatch.resume` continues, and its service, given the events sent and their text."""
        return (body if self.to_chat is None else self.to_chat(body)), self.service

    def spliced(self, event: dict[str, Any], first: dict[str, Any]) -> dict[str, Any] | None:
        """Under the first stream's id, created and model; no second role."""
        event.update({field: first[field] for field in ("id", "created", "model") if field in first})
        for choice in event.get("choices", ()):
            (choice.get("delta") or {}).pop("role", None)
        return event


class _Messages(_Api):
    """Anthropic's events: the message and its text block were started by the first stream; the continuation's
    deltas go on in that block (its index), then its stop, the message's delta (stop reason, usage) and stop."""

    framing = FRAMINGS["anthropic"]

    def text(self, event: dict[str, Any]) -> str:
        delta = event.get("delta") or {}
        return str(delta.get("text") or "") if event.get("type") == "content_block_delta" else ""

    def spliced(self, event: dict[str, Any], first: dict[str, Any]) -> dict[str, Any] | None:
        if event.get("type") in ("message_start", "ping", "content_block_start"):
            return None
        if "index" in event:
            event["index"] = first.get("index", 0)
        return event


class _Responses(_Api):
    """The Responses API's events: the service made again for the response the first stream began (its id, its
    creation, the message open with the text so far, the next sequence number), so that it goes on with that
    message's deltas, closes it and ends with one response.completed (stored as the first stream would have). A
    stream whose message is not the only item it began (tool calls, MCP) is not continued."""

    framing = NAMED

    def text(self, event: dict[str, Any]) -> str:
        return str(event.get("delta") or "") if event.get("type") == "response.output_text.delta" else ""

    async def continuing(self, state: GatewayState, context: RequestContext, body: Any, events: list[dict[str, Any]],
                         text: str) -> tuple[Any, Service[Any, Any, Any]]:
        created = [event["response"] for event in events if event.get("type") == "response.created"]
        items = [event["item"] for event in events if event.get("type", "").startswith("response.output_item.")]
        if responses_mcp.applies(body) or len(created) != 1 or len(items) != 1 or items[0].get("type") != "message":
            raise ServiceUnavailable(DIED)
        mine = state.responses.of(context.tenant)
        turn = await joined(Conversations(mine, state.settings.max_body_bytes), body)
        service = ResponsesService(body, turn.items if turn else await history_of(mine, body.previous_response_id),
                                   mine, turn)
        response = Response.model_validate(created[0])
        service.id, service.created = response.id, response.created_at
        sequence = max(int(event.get("sequence_number", 0)) for event in events) + 1
        service.events = ResponseEvents.resumed(response, sequence, OutputMessage.model_validate(items[0]), text)
        return service.chat_request(), service

    def spliced(self, event: dict[str, Any], first: dict[str, Any]) -> dict[str, Any] | None:
        return event  # made by the first stream's service state: its ids and numbers already


APIS: dict[str, _Api] = {
    "/v1/chat/completions": _Api(ChatCompletionRequest, CHAT, lambda choice: (choice.get("delta") or {}).get("content")),
    "/v1/completions": _Api(CompletionRequest, COMPLETIONS, lambda choice: choice.get("text")),
    "/v1/messages": _Messages(MessagesRequest, MESSAGES, lambda choice: None, to_chat),
    "/v1/responses": _Responses(ResponsesRequest, CHAT, lambda choice: None),
}


def continuation(state: GatewayState) -> Continuation:
    """The hook `StreamStore.continuation` takes: the rest of a stream whose producer died, framed (its last frame
    the stream's end)."""

    async def continued(takeover: Takeover, produced: list[bytes]) -> AsyncGenerator[bytes, None]:
        api = APIS.get(takeover.path)
        if api is None:  # a path no stream is resumed by (the native API's): the error event
            yield _error(ServiceUnavailable(DIED), FRAMINGS["openai"])
            yield FRAMINGS["openai"].end
            return
        context = RequestContext(request_id="req_" + secrets.token_hex(16), key_id=takeover.owner.key_id,
                                 tenant=takeover.owner.tenant, body_bytes=len(takeover.request))
        record = context.record
        record.api_key_id = takeover.owner.key_id
        opened, status = open_record(record), 200
        try:
            async for frame in _continued(context, state, takeover, api, produced):
                yield frame
        except Exception as exc:  # the stream has started: its failure is one error event, as any stream's
            status = from_exception(exc).status
            log.warning("stream_takeover_failed", error=str(exc), error_type=type(exc).__name__)
            yield _error(exc, api.framing)
        finally:
            if context.policy is not None:  # its usage counted and its charge settled, as the middleware does
                usage = (record.prompt_tokens or 0, record.completion_tokens or 0)
                state.quota.finish(context.policy, status, context.charge, usage)
            close_record(opened)
        yield api.framing.end

    return continued


DIED = "The stream's producer stopped before the stream's end (its replica is gone); the events it produced were sent"


def _error(exc: Exception, framing: Framing) -> bytes:
    return error_frame(from_exception(exc).body(framing.dialect), framing)


def _framed(event: dict[str, Any], framing: Framing) -> bytes:
    data = b"data: " + orjson.dumps(event) + b"\n\n"
    return b"event: " + str(event.get("type", "message")).encode() + b"\n" + data if framing.named else data


async def _continued(context: RequestContext, state: GatewayState, takeover: Takeover, api: _Api,
                     produced: list[bytes]) -> AsyncGenerator[bytes, None]:
    """The continuation's events, as the first stream's (`_Api.spliced`)."""
    identity = state.identities.reidentify(Identity(takeover.owner.key_id, takeover.owner.tenant))
    if identity is None:
        raise AuthenticationFailed("The API key that started this stream is no longer valid.")
    if not takeover.request:
        raise ServiceUnavailable(DIED)  # its body was too large to keep: nothing to continue
    context.key_id = context.record.api_key_id = identity.key_id
    policy = context.policy = state.tenants.policy(identity.key_id)
    context.record.response_headers.update(await state.quota.take_request(policy))
    try:
        body = api.request.model_validate_json(takeover.request)
    except ValidationError as exc:
        raise invalid_body(exc, takeover.request) from exc
    events = [event for frame in produced for event in payloads(frame) if isinstance(event, dict)]
    texts = [(event, text) for event in events if (text := api.text(event))]
    if not texts:
        raise ServiceUnavailable(DIED)  # not one token out: the client may simply ask again
    text, first = "".join(text for _, text in texts), texts[0][0]
    request, service = await api.continuing(state, context, body, events, text)
    answer = await resume(context, state, request, service, text, len(texts))
    if not isinstance(answer, Stream):  # a cached whole answer is no continuation of this one
        raise ServiceUnavailable(DIED)
    try:
        async for event in answer.events:
            spliced = api.spliced(orjson.loads(event if isinstance(event, bytes) else json_bytes(event)), first)
            if spliced is not None:
                yield _framed(spliced, api.framing)
    finally:
        await answer.events.aclose()
        if answer.on_close is not None:
            answer.on_close()
