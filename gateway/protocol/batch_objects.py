"""The Batches and Files APIs' objects, field by field as the `openai` SDK's, and what the store keeps of a batch beside
its object (who created it)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from gateway.protocol.response_objects import InputTokensDetails, OutputTokensDetails

Status = Literal["validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"]
Endpoint = Literal["/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses"]
DONE: frozenset[str] = frozenset({"failed", "completed", "expired", "cancelled"})  # nothing more will happen
WINDOW_S = 24 * 3600  # completion_window "24h"


class BatchError(BaseModel):
    code: str | None = None
    line: int | None = None
    message: str | None = None
    param: str | None = None


class Errors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class RequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchUsage(BaseModel):
    input_tokens: int = 0
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int = 0
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int = 0


class Batch(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: Errors | None = None
    input_file_id: str
    completion_window: str = "24h"
    status: Status
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: RequestCounts = Field(default_factory=RequestCounts)
    metadata: dict[str, str] | None = None
    usage: BatchUsage = Field(default_factory=BatchUsage)


class Owner(BaseModel):
    """Who created a batch: its lines run as that key, found again for each line (`reidentify`: gone since, a 401)."""

    key_id: str
    tenant: str


class StoredBatch(BaseModel):
    """A batch as kept: its object and its creator."""

    batch: Batch
    owner: Owner
    output_expires_after_s: int
    created_ns: int = 0  # orders batches made within one second (created_at counts seconds)
    expired_lines: int = 0  # lines never run, written to the error file as expired (a batch that expired)


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
