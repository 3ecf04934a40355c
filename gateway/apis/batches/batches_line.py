"""One line of a batch, run as the same request sent to its route would be: its body parsed with the route's protocol
model, then the whole pipeline (`dispatch`), as the key that created the batch (found again for each line: gone since,
the line fails, 401), answered as the route encodes its answer. What differs from the route: the line runs in the batch
lane (`priority.BATCH`), nobody can disconnect, a stream or a background response is refused (an error answer), and a
refusal by the key's rate limits, a model's full queue or any 503 that says when to retry (`Retry-After`: an engine that
cannot serve now, busy compilers) is not an answer but `Retry` (the batch pauses, it does not fail). A spent budget is an answer (429 `insufficient_quota`)."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Awaitable, Callable
from typing import Any

import orjson
import structlog
from pydantic import ValidationError

from gateway import errors
from gateway.apis.batches.batches_input import MESSAGES, BatchLine
from gateway.apis.chat.chat_serving import CHAT
from gateway.apis.completions.completions_serving import COMPLETIONS
from gateway.apis.embeddings.embeddings_serving import EMBEDDINGS
from gateway.apis.messages import messages_serving
from gateway.apis.messages.messages_wire import MessagesRequest
from gateway.apis.responses.responses_serving import ResponsesService, history_of
from gateway.apis.responses.responses_wire import ResponsesRequest
from gateway.pipeline.answer import Stream, Whole, whole_json
from gateway.pipeline.context import RequestContext
from gateway.pipeline.dispatch import dispatch
from gateway.pipeline.state import GatewayState
from gateway.protocol.batch_objects import Owner
from gateway.protocol.embeddings import EmbeddingRequest
from gateway.protocol.openai import ChatCompletionRequest, CompletionRequest
from gateway.stores.batchdb import Answer
from gateway.telemetry.record import close_record, open_record
from gateway.tenancy import priority
from gateway.tenancy.keys import Identity

log = structlog.get_logger(__name__)
_CANCELLED = 499  # the status a line's usage is counted under when its run was cancelled
EXPIRED = {"code": "batch_expired", "message": "This request could not be executed before the completion window expired."}


class Retry(Exception):
    """The key's rate limits (or a full queue, a dead engine) refused the line for now: run it again after `wait_s`."""

    def __init__(self, wait_s: float) -> None:
        super().__init__(f"retry in {wait_s:g} s")
        self.wait_s = wait_s


Run = Callable[[RequestContext, GatewayState, bytes], Awaitable[Whole | Stream]]


def _parsed(model: type[Any], body: bytes) -> Any:
    try:
        parsed = model.model_validate_json(body)
    except ValidationError as exc:
        raise errors.invalid_body(exc, body) from exc
    if getattr(parsed, "stream", False):
        raise errors.InvalidRequest("A batch's requests are not streamed: leave out 'stream' (or set it to false)",
                                    "stream")
    if getattr(parsed, "background", False):
        raise errors.InvalidRequest("A batch's requests already run in the background: leave out 'background'",
                                    "background")
    return parsed


def _route(model: type[Any], service: Any, to_chat: Callable[[Any], Any] | None = None) -> Run:
    """A route whose body is `model`, run by `service` (chat, completions, embeddings; a request of Anthropic's Message
    Batches as `api.messages.create` runs it: made a chat request, `to_chat`)."""
    async def run(context: RequestContext, state: GatewayState, body: bytes) -> Whole | Stream:
        request = _parsed(model, body)
        return await dispatch(context, state, request if to_chat is None else to_chat(request), service)

    return run


async def _responses(context: RequestContext, state: GatewayState, body: bytes) -> Whole | Stream:
    """As `api.responses.create` runs a whole response: its history read, stored when it asks to be."""
    request: ResponsesRequest = _parsed(ResponsesRequest, body)
    mine = state.responses.of(context.tenant)
    service = ResponsesService(request, await history_of(mine, request.previous_response_id), mine)
    answer = await dispatch(context, state, service.chat_request(), service)
    await service.save()
    return answer


ROUTES: dict[str, Run] = {
    "/v1/chat/completions": _route(ChatCompletionRequest, CHAT),
    "/v1/completions": _route(CompletionRequest, COMPLETIONS),
    "/v1/embeddings": _route(EmbeddingRequest, EMBEDDINGS),
    "/v1/responses": _responses,
    MESSAGES: _route(MessagesRequest, messages_serving.MESSAGES, messages_serving.to_chat),
}


def result_line(custom_id: str, response: dict[str, Any] | None) -> bytes:
    """A line of the output (or error) file, as OpenAI's: the route's status, request id and body (JSON already), or
    none (a line the batch's expiry left unrun)."""
    return orjson.dumps({"id": "batch_req_" + secrets.token_hex(16), "custom_id": custom_id, "response": response,
                         "error": EXPIRED if response is None else None})


async def run_line(state: GatewayState, owner: Owner, line: BatchLine, retry_s: float, expires_at: float | None) -> Answer:
    """The line's answer (an error is an answer too); `Retry` when the key's rate limits refuse it for now. Its
    deadline is its batch's window's end (`expires_at`, Unix time)."""
    context = RequestContext(request_id="req_" + secrets.token_hex(16), key_id=owner.key_id, tenant=owner.tenant,
                             lane=priority.BATCH, body_bytes=len(line.body))
    if expires_at is not None:
        context.deadline = asyncio.get_running_loop().time() + (expires_at - time.time())
    record = context.record
    record.api_key_id = owner.key_id
    opened = open_record(record)
    status = _CANCELLED
    try:
        try:
            answer = await _answer(context, state, owner, line.url, line.body)
            status, data = _one_line(answer.status, whole_json(answer))
        except Exception as exc:  # an error is this line's answer, as the route would render it
            error: errors.APIError = errors.from_exception(exc)
            wait = error.headers.get("Retry-After") or error.headers.get("retry-after")
            unavailable = isinstance(error, errors.ServiceUnavailable)
            if isinstance(error, errors.RateLimited) or (unavailable and wait is not None):
                status = error.status  # refused for now (a full queue whatever its status, a dead engine): it pauses
                raise Retry(max(retry_s, float(wait) if wait is not None and wait.isdigit() else 0.0)) from None
            if not isinstance(exc, errors.APIError):  # a bug: logged as the route's exception handler logs it
                log.exception("batch_line_failed", request_id=context.request_id, error=type(exc).__name__)
            status, data = error.status, orjson.dumps(error.body("anthropic" if line.url == MESSAGES else "openai"))
        response = {"status_code": status, "request_id": context.request_id, "body": orjson.Fragment(data)}
        return Answer(line.custom_id, 200 <= status < 300, result_line(line.custom_id, response),
                      prompt=record.prompt_tokens or 0, completion=record.completion_tokens or 0)
    finally:
        if context.policy is not None:  # the request's usage counted and its charge settled, as the middleware does
            state.quota.finish(context.policy, status, context.charge, (record.prompt_tokens or 0, record.completion_tokens or 0))
        close_record(opened)


def _one_line(status: int, data: bytes) -> tuple[int, bytes]:
    """An answer's body as one line of JSON, for the output file (JSON Lines, read back on a resume):
    a remote model's body comes as the upstream wrote it, maybe over several lines, maybe not JSON
    (a proxy's error page: a 502, as the route's unreadable answer is)."""
    try:
        return status, orjson.dumps(orjson.loads(data))
    except orjson.JSONDecodeError:
        error = errors.BadGateway("The model answered with what is not JSON.")
        return error.status, orjson.dumps(error.body())


async def _answer(context: RequestContext, state: GatewayState, owner: Owner, url: str, body: bytes) -> Whole:
    identity = state.identities.reidentify(Identity(owner.key_id, owner.tenant))
    if identity is None:
        raise errors.AuthenticationFailed("The API key that created this batch is no longer valid.")
    context.key_id = context.record.api_key_id = identity.key_id
    policy = context.policy = state.tenants.policy(identity.key_id)
    context.record.response_headers.update(await state.quota.take_request(policy))
    answer = await ROUTES[url](context, state, body)
    assert isinstance(answer, Whole)  # streams are refused (`_parsed`)
    return answer
