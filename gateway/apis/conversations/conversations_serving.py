"""The Conversations API's translation and store. A conversation and its items are one object of the asking tenant's
in the responses' store (`stores.responses`, kind `conv_`: the same backend, expiry and owner check as a stored
response); its items are read from input items as the Responses API reads them. A Responses request's
`conversation` (`joined`) reads the conversation's items as the context before its input, and adds its input and
output to it once answered (`Turn`). A conversation holds at most `most_bytes` of JSON (the body bound: no more than
one request could send as its input instead); a turn may take it past that once, after which it takes nothing more.
Two writers of one conversation at once (on any replicas) both write: each change is made to the conversation as
stored when it is written (`OwnedResponses.change`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

from gateway.apis.conversations.conversations_wire import Conversation, ConversationCreate, StoredConversation
from gateway.apis.responses.responses_serving import conversation_of, input_items
from gateway.apis.responses.responses_wire import ResponsesRequest, new_id
from gateway.errors import APIError, InvalidRequest, NotFound
from gateway.protocol.response_objects import Item, OutputItem
from gateway.serving.generation import now
from gateway.stores.responses import Kind, OwnedResponses

log = structlog.get_logger(__name__)


def not_found(conversation_id: str) -> NotFound:
    return NotFound(f"Conversation with id '{conversation_id}' not found.", "conversation_id")


CONVERSATION = Kind("conv_", not_found)


def _unique(items: list[Item], adding: Sequence[str | None], param: str) -> None:
    """Refuse an item id given twice, or already in the conversation (`adding`: the ids given, None for new ones)."""
    seen = {item.id for item in items}
    for i, item_id in enumerate(adding):
        if item_id is None:
            continue
        if item_id in seen:
            raise InvalidRequest(f"Duplicate item found with id {item_id}. Remove duplicate items from your input and "
                                 "try again.", f"{param}.{i}.id")
        seen.add(item_id)


@dataclass(slots=True, frozen=True)
class Conversations:
    """One owner's conversations (another owner's id is an unknown id: `OwnedResponses`), each at most `most_bytes`."""

    mine: OwnedResponses
    most_bytes: int

    async def get(self, conversation_id: str) -> StoredConversation:
        return await self.mine.load(CONVERSATION, conversation_id, StoredConversation)

    async def create(self, body: ConversationCreate) -> Conversation:
        items = input_items(body.items, "items")
        _unique([], [item.id for item in body.items or []], "items")
        made = Conversation(id=new_id("conv"), created_at=now(), metadata=body.metadata or {})
        stored = StoredConversation(conversation=made, items=items)
        self.full(stored, "items")
        await self.mine.keep(CONVERSATION, made.id, stored)
        return made

    async def update(self, conversation_id: str, metadata: dict[str, str] | None) -> Conversation:
        def replace(stored: StoredConversation) -> None:
            stored.conversation.metadata = metadata or {}

        return (await self._change(conversation_id, replace)).conversation

    async def delete(self, conversation_id: str) -> None:
        await self.mine.drop(CONVERSATION, conversation_id)

    async def add(self, conversation_id: str, items: list[Item], given: Sequence[str | None] | None = None) -> None:
        """Append `items`: with `given` (the ids the client gave them), refused when one is already there or they take
        it past its bound, as the `items` field's; without (a turn's, answered already), those already there (a
        concurrent turn's with the same input) are left out."""

        def append(stored: StoredConversation) -> None:
            if given is not None:
                _unique(stored.items, given, "items")
                stored.items += items
                self.full(stored, "items")
            else:
                there = {item.id for item in stored.items}
                stored.items += [item for item in items if item.id not in there]

        await self._change(conversation_id, append)

    async def item(self, conversation_id: str, item_id: str) -> Item:
        stored = await self.get(conversation_id)
        return stored.items[_index(stored, item_id)]

    async def remove_item(self, conversation_id: str, item_id: str) -> Conversation:
        def remove(stored: StoredConversation) -> None:
            del stored.items[_index(stored, item_id)]

        return (await self._change(conversation_id, remove)).conversation

    def full(self, stored: StoredConversation, param: str) -> int:
        """Its size in bytes; refused past its bound (`param`: the field that asked to add to it)."""
        size = len(stored.__pydantic_serializer__.to_json(stored))
        if size > self.most_bytes:
            raise InvalidRequest(f"Conversation with id '{stored.conversation.id}' would hold {size} bytes, past its "
                                 f"limit of {self.most_bytes}; start a new conversation", param)
        return size

    async def _change(self, conversation_id: str, change: Callable[[StoredConversation], None]) -> StoredConversation:
        """`change` made to the conversation as stored when it is written (two requests at once: both changes kept)."""
        return await self.mine.change(CONVERSATION, conversation_id, StoredConversation, change)


def _index(stored: StoredConversation, item_id: str) -> int:
    """Where the item is in this conversation (an item of another conversation is unknown here)."""
    for i, item in enumerate(stored.items):
        if item.id == item_id:
            return i
    raise NotFound(f"Item with id '{item_id}' not found.", "item_id")


@dataclass(slots=True)
class Turn:
    """A Responses request's conversation: its items (the context before the request's input), and `add`, which the
    answered turn goes to (`responses_serving.Joined`)."""

    conversations: Conversations
    id: str
    items: list[Item]
    size: int  # its bytes, as stored: the request's preparation reads them as it reads the body's (`offload`)

    async def add(self, given: list[Item], output: list[OutputItem]) -> None:
        try:
            await self.conversations.add(self.id, [*given, *output])
        except APIError as exc:  # deleted meanwhile, or the store down: the answer stands without the conversation
            log.warning("conversation_turn_not_added", error=exc.message, status=exc.status)


async def joined(conversations: Conversations, request: ResponsesRequest) -> Turn | None:
    """The conversation `request` continues, if it names one (OpenAI's refusals: with `previous_response_id` too; one
    of its input items' ids already in the conversation; ours: a conversation past its bound)."""
    ref = conversation_of(request)
    if ref is None:
        return None
    if request.previous_response_id is not None:
        raise InvalidRequest("Mutually exclusive parameters: Ensure you are only providing one of: "
                             "'previous_response_id' or 'conversation'.", "conversation", "mutually_exclusive_parameters")
    try:
        stored = await conversations.get(ref.id)
    except NotFound as exc:
        raise NotFound(exc.message, "conversation") from None
    size = conversations.full(stored, "conversation")
    _unique(stored.items, [None] if isinstance(request.input, str) else [item.id for item in request.input or []],
            "input")
    return Turn(conversations, ref.id, stored.items, size)
