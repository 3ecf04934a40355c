"""The batch lane's stores on local disk for unit tests (as the app builds them with the default
`store.backend`), and a batch's objects reached by its id alone, as a test that plays another
replica, or a crash, needs them."""

from __future__ import annotations

import asyncio
from pathlib import Path

from gateway.stores.batches import BatchObjects, BatchStore
from gateway.stores.blobs import DiskBlobs
from gateway.stores.files import FileStore
from gateway.stores.spool import Spool


def disk_files(directory: Path) -> FileStore:
    return FileStore.on(DiskBlobs.at(directory), Spool.at(directory / ".spool"))


def disk_batches(directory: Path) -> BatchStore:
    return BatchStore.on(DiskBlobs.at(directory), Spool.at(directory / ".spool"))


def batch_in(directory: Path, batch_id: str) -> BatchObjects:
    """The objects of the batch `batch_id`, whoever its owner (a test's view, never the API's)."""
    store = disk_batches(directory)
    [record] = [n for n in asyncio.run(store.blobs.list("")) if n.endswith(f"/{batch_id}/record.json")]
    return BatchObjects(store.blobs, store.spool, record.partition("/")[0], batch_id)


def read(batch: BatchObjects, part: str) -> bytes | None:
    """One of a batch's objects, whole (None: there is none)."""
    return asyncio.run(batch.blobs.get(batch.name(part)))
