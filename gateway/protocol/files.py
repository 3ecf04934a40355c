"""The Files API's objects, field by field as the `openai` SDK's, and the list's query."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# `batch`: a batch's input, the one purpose an upload may have (others are a 400 naming `purpose`);
# `batch_output`: a batch's output or error file, written by the gateway (`stores.batches`)
Purpose = Literal["batch", "batch_output"]
PURPOSES: tuple[str, ...] = ("batch",)  # what an upload may name


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: Purpose
    status: Literal["uploaded", "processed", "error"] = "processed"  # checked before it was stored
    expires_at: int | None = None
    status_details: str | None = None


class FileList(BaseModel):
    """GET /v1/files: a page of the asking key's files."""

    object: Literal["list"] = "list"
    data: list[FileObject]
    first_id: str | None
    last_id: str | None
    has_more: bool


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class FileListQuery(BaseModel):
    """The query of GET /v1/files (values arrive as strings)."""

    model_config = ConfigDict(extra="ignore", strict=False)
    purpose: str | None = None
    after: str | None = None
    limit: Annotated[int, Field(ge=1, le=10_000)] = 10_000
    order: Literal["asc", "desc"] = "desc"
