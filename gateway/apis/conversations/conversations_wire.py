"""The Conversations API's wire models, after `openai.types.conversations`: the conversation object, the bodies that
create and update one or add its items, its deletion; and the conversation as stored (the object and its items)."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field, field_validator

from gateway.apis.responses.responses_wire import InputItem, known_items
from gateway.protocol.openai import _Request
from gateway.protocol.response_objects import Item, Metadata, _Out

MOST_ADDED = 20  # OpenAI's bound on the items one request adds
Added = Annotated[list[InputItem], Field(max_length=MOST_ADDED)]


class ConversationCreate(_Request):
    """POST /v1/conversations."""

    items: Added | None = None
    metadata: Metadata | None = None
    safety_identifier: str | None = None  # accepted, as OpenAI's; nothing here reads it

    _known_items = field_validator("items", mode="before")(known_items)


class ConversationUpdate(_Request):
    """POST /v1/conversations/{conversation_id}: the metadata, replaced whole (null: none)."""

    metadata: Metadata | None


class ItemsCreate(_Request):
    """POST /v1/conversations/{conversation_id}/items."""

    items: Added

    _known_items = field_validator("items", mode="before")(known_items)


class Conversation(_Out):
    id: str
    object: Literal["conversation"] = "conversation"
    created_at: int
    metadata: dict[str, str] = Field(default_factory=dict)


class ConversationDeleted(_Out):
    id: str
    object: Literal["conversation.deleted"] = "conversation.deleted"
    deleted: bool = True


class StoredConversation(BaseModel):
    conversation: Conversation
    items: list[Item] = Field(default_factory=list)  # oldest first
