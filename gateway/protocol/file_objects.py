"""The Files API's objects, field by field as the `openai` SDK's, and the list's query."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel

# `batch`: a batch's input, the one purpose an upload may have (others are a 400 naming `purpose`);
# `batch_output`: a batch's output or error file, written by the gateway (`stores.batches`)
Purpose = Literal["batch", "batch_output"]


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
