"""The batches API's wire models."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.protocol.batch_objects import Batch, Endpoint
from gateway.protocol.response_objects import Metadata


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=3600, le=30 * 86400)]


class BatchCreate(BaseModel):
    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: Metadata | None = None
    output_expires_after: OutputExpiresAfter | None = None


class BatchList(BaseModel):
    """GET /v1/batches: a page of the asking key's batches, newest first."""

    object: Literal["list"] = "list"
    data: list[Batch]
    first_id: str | None
    last_id: str | None
    has_more: bool


class BatchListQuery(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=False)
    after: str | None = None
    limit: Annotated[int, Field(ge=1, le=100)] = 20

