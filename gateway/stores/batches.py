"""The Batches API's and Message Batches API's store: each batch a record with its answers (`stores.batchdb`) and its
input, a blob written once when the batch is created. A batch is reached only through its owner's view (`of`); only the
runner reaches one by its id alone."""

from __future__ import annotations

import re
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from gateway.errors import InvalidRequest, NotFound
from gateway.protocol.batch_objects import DONE, WINDOW_S, Batch, Owner, RequestCounts, StoredBatch
from gateway.stores.blobs import put_chunks
from gateway.stores.files import Store, page_of

BATCH, MESSAGE_BATCH = "batch_", "msgbatch_"  # the id prefixes of OpenAI's batches and Anthropic's
ID = re.compile(r"(?:msg)?batch_[0-9a-f]{32}")
EXPIRED_CODE = "batch_expired"  # the error of a line a batch past its window never ran


def not_found(batch_id: str, param: str = "batch_id") -> NotFound:
    return NotFound(f"No batch found with id '{batch_id}'.", param=param)


def new_id(kind: str = BATCH) -> str:
    return kind + secrets.token_hex(16)


def input_name(batch_id: str) -> str:
    return f"{batch_id}.input.jsonl"


class BatchStore(Store):
    def of(self, owner: str, kind: str = BATCH) -> OwnedBatches:
        return OwnedBatches(self, owner, kind)


@dataclass(slots=True, frozen=True)
class OwnedBatches:
    store: Store
    owner: str
    kind: str = BATCH

    async def find(self, batch_id: str, param: str = "batch_id") -> StoredBatch:
        ours = batch_id.startswith(self.kind) and ID.fullmatch(batch_id) is not None
        stored = await self.store.records.batch(batch_id) if ours else None
        if stored is None or stored.owner.tenant != self.owner:
            raise not_found(batch_id, param)
        return stored

    def new(self, key_id: str, endpoint: str, output_expires_after_s: int, input_file_id: str | None = None,
            metadata: dict[str, str] | None = None, total: int = 0) -> StoredBatch:
        """A new batch of this owner's, `validating`, its input the file `input_file_id` (or its own, by its id)."""
        now, batch_id = int(time.time()), new_id(self.kind)
        batch = Batch(id=batch_id, endpoint=endpoint, input_file_id=input_file_id or batch_id, status="validating",
                      created_at=now, expires_at=now + WINDOW_S, metadata=metadata,
                      request_counts=RequestCounts(total=total))
        return StoredBatch(batch=batch, owner=Owner(key_id=key_id, tenant=self.owner),
                           output_expires_after_s=output_expires_after_s, created_ns=time.time_ns())

    async def create(self, stored: StoredBatch, source: AsyncIterator[bytes] | bytes) -> None:
        """The input first, then the record: a reader sees a whole batch or none."""
        name = input_name(stored.batch.id)
        await put_chunks(self.store.blobs, name, source)
        await self.store.recorded(name, self.store.records.create(stored))

    async def cancel(self, batch_id: str, param: str = "batch_id", ended: str | None = None) -> StoredBatch:
        """Ask for a cancel (the runner holding the batch carries it out); a batch already done is a 400 (message
        `ended` when given)."""
        stored = await self.find(batch_id, param)
        if stored.batch.status in DONE:
            raise InvalidRequest(ended or f"Cannot cancel a batch with status '{stored.batch.status}'.", param=param)
        await self.store.records.ask_cancel(batch_id)
        return await self.find(batch_id, param)

    async def delete(self, batch_id: str, param: str = "batch_id") -> None:
        """Its record first, so it is gone for every reader at once."""
        stored = await self.find(batch_id, param)
        if stored.batch.status not in DONE:
            raise InvalidRequest(f"Batch '{batch_id}' is still being processed: cancel it and delete it once it "
                                 "has ended.", param=param)
        await self.store.records.remove(batch_id)
        await self.store.blobs.delete(input_name(batch_id))

    async def page(self, after: str | None, limit: int, before: str | None = None,
                   names: tuple[str, str] = ("after", "before")) -> tuple[list[StoredBatch], bool]:
        """A page of this owner's batches, newest first (`page_of`)."""
        stored = [s for s in await self.store.records.batches(self.owner) if s.batch.id.startswith(self.kind)]
        stored.sort(key=lambda s: (s.batch.created_at, s.created_ns, s.batch.id), reverse=True)
        return page_of(stored, [s.batch.id for s in stored], limit, after, before, names, "No batch to list")
