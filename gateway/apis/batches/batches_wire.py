"""The batches API's wire models."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from gateway.protocol.batch_objects import MAX_KEY, MAX_METADATA, MAX_VALUE, Batch, Endpoint


def _check_metadata(metadata: dict[str, str] | None) -> dict[str, str] | None:
    if metadata is None:
        return None
    if len(metadata) > MAX_METADATA:
        raise ValueError(f"at most {MAX_METADATA} key-value pairs are allowed")
    for key, value in metadata.items():
        if len(key) > MAX_KEY:
            raise ValueError(f"a key is at most {MAX_KEY} characters long")
        if len(value) > MAX_VALUE:
            raise ValueError(f"a value is at most {MAX_VALUE} characters long")
    return metadata


class OutputExpiresAfter(BaseModel):
    model_config = ConfigDict(extra="forbid")
    anchor: Literal["created_at"]
    seconds: Annotated[int, Field(ge=3600, le=30 * 86400)]


class BatchCreate(BaseModel):
    """POST /v1/batches: unknown fields are a 400 naming them."""

    model_config = ConfigDict(extra="forbid")
    input_file_id: str
    endpoint: Endpoint
    completion_window: Literal["24h"]
    metadata: dict[str, str] | None = None
    output_expires_after: OutputExpiresAfter | None = None

    _metadata = field_validator("metadata")(_check_metadata)


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

