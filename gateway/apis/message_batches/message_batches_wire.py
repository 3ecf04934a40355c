"""Anthropic's Message Batches API, field by field as the `anthropic` SDK's types. A request's `params` is kept as
sent and checked when its line runs, as Anthropic does (a bad one is an `errored` result)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

ProcessingStatus = Literal["in_progress", "canceling", "ended"]


class MessageBatchRequest(BaseModel):
    """One request of a batch: its custom_id and a Messages request's body (not streamed)."""

    model_config = ConfigDict(extra="forbid")
    custom_id: Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]  # Anthropic's pattern
    params: dict[str, Any]


class MessageBatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    requests: Annotated[list[MessageBatchRequest], Field(min_length=1)]


class MessageBatchRequestCounts(BaseModel):
    processing: int = 0
    succeeded: int = 0
    errored: int = 0
    canceled: int = 0
    expired: int = 0


class MessageBatch(BaseModel):
    id: str
    type: Literal["message_batch"] = "message_batch"
    processing_status: ProcessingStatus
    request_counts: MessageBatchRequestCounts
    created_at: datetime
    expires_at: datetime
    ended_at: datetime | None = None
    archived_at: datetime | None = None
    cancel_initiated_at: datetime | None = None
    results_url: str | None = None


class MessageBatchList(BaseModel):
    """GET /v1/messages/batches: a page of the asking key's batches, newest first."""

    data: list[MessageBatch]
    has_more: bool
    first_id: str | None
    last_id: str | None


class MessageBatchListQuery(BaseModel):
    before_id: str | None = None
    after_id: str | None = None
    limit: Annotated[int, Field(ge=1, le=1000)] = 20


class DeletedMessageBatch(BaseModel):
    id: str
    type: Literal["message_batch_deleted"] = "message_batch_deleted"
