"""A resumable stream taken over on this replica when the one producing it died (`StreamStore.continuation`,
docs/streams.md "a dead replica"): the key that asked found again (`Authenticator.reidentify`, as a batch's lines
are), its request parsed again for the API at its path, the text already sent read out of the events produced, and
the answer continued from there on the one pipeline (`dispatch.resume`: the key's reach, guards, limits, admission,
fallbacks). Its chunks carry the first stream's ids (chat's `id`, `created`, `model`), so the client sees one
stream. Chat Completions and Completions are continued; another API's stream ends with the error event as before.
"""

from __future__ import annotations

import secrets
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass
from typing import Any

import orjson
import structlog
from pydantic import ValidationError

from gateway.apis.chat.chat_serving import CHAT
from gateway.apis.completions.completions_serving import COMPLETIONS
from gateway.errors import AuthenticationFailed, ServiceUnavailable, invalid_body
from gateway.pipeline.answer import Stream, json_bytes
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import resume
from gateway.pipeline.state import GatewayState
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest, SamplingFields
from gateway.protocol.sse_wire import DONE, FRAMINGS, NAMED, Framing, encode, error_frame, payloads
from gateway.serving.service import Service
from gateway.stores.streams import Continuation, Takeover
from gateway.telemetry.record import close_record, open_record
from gateway.tenancy.keys import Identity
from gateway.web.error_render import from_exception

log = structlog.get_logger(__name__)
FRAMING = FRAMINGS["openai"]
OTHERS: dict[str, Framing] = {"/v1/messages": FRAMINGS["anthropic"], "/v1/responses": NAMED}  # not continued yet


@dataclass(frozen=True, slots=True)
class _Api:
    """A stream's API, as a takeover continues it: its request, its service, where a chunk's text is."""

    request: type[SamplingFields]
    service: Service[Any, Any, Any]
    text: Callable[[dict[str, Any]], str | None]


APIS: dict[str, _Api] = {
    "/v1/chat/completions": _Api(ChatCompletionRequest, CHAT, lambda choice: (choice.get("delta") or {}).get("content")),
    "/v1/completions": _Api(CompletionRequest, COMPLETIONS, lambda choice: choice.get("text")),
}


def continuation(state: GatewayState) -> Continuation:
    """The hook `StreamStore.continuation` takes: the rest of a stream whose producer died, framed (its last frame
    the stream's end)."""

    async def continued(takeover: Takeover, produced: list[bytes]) -> AsyncGenerator[bytes, None]:
        api = APIS.get(takeover.path)
        if api is None:
            framing = OTHERS.get(takeover.path, FRAMING)
            yield error_frame(from_exception(ServiceUnavailable(DIED)).body(framing.dialect), framing)
            yield framing.end
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
            error = from_exception(exc)
            status = error.status
            log.warning("stream_takeover_failed", error=str(exc), error_type=type(exc).__name__)
            yield _error(exc)
        finally:
            if context.policy is not None:  # its usage counted and its charge settled, as the middleware does
                usage = (record.prompt_tokens or 0, record.completion_tokens or 0)
                state.quota.finish(context.policy, status, context.charge, usage)
            close_record(opened)
        yield DONE

    return continued


DIED = "The stream's producer stopped before the stream's end (its replica is gone); the events it produced were sent"


def _error(exc: Exception) -> bytes:
    return error_frame(from_exception(exc).body("openai"), FRAMING)


async def _continued(context: RequestContext, state: GatewayState, takeover: Takeover, api: _Api,
                     produced: list[bytes]) -> AsyncGenerator[bytes, None]:
    """The continuation's chunks, under the first stream's id, created and model."""
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
    chunks = [p for frame in produced for p in payloads(frame) if isinstance(p, dict) and p.get("choices")]
    if not chunks:
        raise ServiceUnavailable(DIED)  # not one token out: the client may simply ask again
    text = "".join(api.text(c["choices"][0]) or "" for c in chunks)
    tokens = sum(1 for c in chunks if api.text(c["choices"][0]))
    answer = await resume(context, state, body, api.service, text, tokens)
    if not isinstance(answer, Stream):  # a cached whole answer is no continuation of this one
        raise ServiceUnavailable(DIED)
    head = {field: chunks[0][field] for field in ("id", "created", "model") if field in chunks[0]}
    try:
        async for event in answer.events:
            chunk = orjson.loads(event if isinstance(event, bytes) else json_bytes(event))
            chunk.update(head)
            for choice in chunk.get("choices", ()):
                (choice.get("delta") or {}).pop("role", None)  # the first stream's first chunk had it
            yield encode(orjson.dumps(chunk))
    finally:
        await answer.events.aclose()
        if answer.on_close is not None:
            answer.on_close()
