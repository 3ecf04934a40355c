"""The Conversations API's routes: create, retrieve, update, delete a conversation; add, list, retrieve, delete its
items. Each goes through the asking key's tenant's view of the store (`conversations_serving.Conversations`)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import Response

from gateway.apis.conversations.conversations_serving import Conversations
from gateway.apis.conversations.conversations_wire import (
    ConversationCreate,
    ConversationDeleted,
    ConversationUpdate,
    ItemsCreate,
)
from gateway.apis.responses.responses_serving import input_items
from gateway.apis.responses.responses_wire import InputItemsQuery, ResponseItemList, item_page
from gateway.pipeline.context import context_of
from gateway.protocol.openai import listing
from gateway.web.answers import json_response
from gateway.web.requests import parse, state_of


def _theirs(request: Request) -> tuple[Conversations, str]:
    """The asking tenant's conversations, and the one the path names."""
    state = state_of(request)
    mine = state.responses.of(context_of(request.scope).tenant)  # the tenant: the same on every replica
    return Conversations(mine, state.settings.max_body_bytes), request.path_params.get("conversation_id", "")


async def create(request: Request) -> Response:
    body = await parse(request, ConversationCreate)
    return json_response(await _theirs(request)[0].create(body))


async def retrieve(request: Request) -> Response:
    conversations, conversation_id = _theirs(request)
    return json_response((await conversations.get(conversation_id)).conversation)


async def update(request: Request) -> Response:
    """Its metadata, replaced whole."""
    conversations, conversation_id = _theirs(request)
    body = await parse(request, ConversationUpdate)
    return json_response(await conversations.update(conversation_id, body.metadata))


async def delete(request: Request) -> Response:
    conversations, conversation_id = _theirs(request)
    await conversations.delete(conversation_id)
    return json_response(ConversationDeleted(id=conversation_id))


async def list_items(request: Request) -> Response:
    """Newest first unless `order=asc`."""
    conversations, conversation_id = _theirs(request)
    query = InputItemsQuery.model_validate(dict(request.query_params))
    stored = await conversations.get(conversation_id)
    return json_response(item_page(stored.items, query, "this conversation"))


async def add_items(request: Request) -> Response:
    conversations, conversation_id = _theirs(request)
    body = await parse(request, ItemsCreate)
    added = input_items(body.items, "items")
    await conversations.add(conversation_id, added, [item.id for item in body.items])
    return json_response(listing(ResponseItemList, added, False))


async def item(request: Request) -> Response:
    conversations, conversation_id = _theirs(request)
    return json_response(await conversations.item(conversation_id, request.path_params["item_id"]))


async def delete_item(request: Request) -> Response:
    """Answers the conversation, as OpenAI's."""
    conversations, conversation_id = _theirs(request)
    return json_response(await conversations.remove_item(conversation_id, request.path_params["item_id"]))
