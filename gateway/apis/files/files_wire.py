"""The files API's wire models."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, Field

from gateway.protocol.batch_objects import FileObject

PURPOSES: tuple[str, ...] = ("batch",)  # what an upload may name


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
    purpose: str | None = None
    after: str | None = None
    limit: Annotated[int, Field(ge=1, le=10_000)] = 10_000
    order: Literal["asc", "desc"] = "desc"

