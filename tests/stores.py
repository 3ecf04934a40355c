"""The batch lane's stores on local disk for unit tests (as the app builds them with the default
`store.backend`), and a batch reached by its id alone, as a test that plays another replica, or a
crash, needs it; and stores that can be taken down (`Flaky`)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import orjson

from gateway.errors import StoreUnavailable
from gateway.protocol.batch_objects import StoredBatch
from gateway.stores.batchdb import SqliteRecords
from gateway.stores.batches import BatchStore, FileStore
from gateway.stores.blobs import LocalBlobs


def disk_files(directory: Path) -> FileStore:
    return FileStore(SqliteRecords(directory / "files.sqlite3"), LocalBlobs(directory))


def disk_batches(directory: Path) -> BatchStore:
    return BatchStore(SqliteRecords(directory / "batches.sqlite3"), LocalBlobs(directory))


def record(directory: Path, batch_id: str) -> StoredBatch:
    """The batch `batch_id` as its readers see it, whoever its owner (a test's view, never the API's)."""
    async def read() -> StoredBatch | None:
        store = disk_batches(directory)
        try:
            return await store.records.batch(batch_id)
        finally:
            await store.aclose()

    found = asyncio.run(read())
    assert found is not None, batch_id
    return found


def answers(directory: Path, batch_id: str, ok: bool | None = None) -> list[dict[str, object]]:
    """The result lines kept for a batch (those answered 2xx, or not, or all), in the order they came."""
    async def read() -> list[dict[str, object]]:
        store = disk_batches(directory)
        try:
            return [orjson.loads(a.line) async for page in store.records.answers(batch_id) for a in page if ok is None or a.ok is ok]
        finally:
            await store.aclose()

    return asyncio.run(read())


class Flaky:
    """One part's stores (its records and its blobs, `wrap`ped) that refuse the calls `refuse` picks by
    method name, or every call while `down` is set, as a backend unreachable right then does (the
    API's 503: `StoreUnavailable`). `calls` records each call's method and first argument; `refused`
    counts the calls refused."""

    def __init__(self) -> None:
        self.down = False
        self.refuse: Callable[[str], bool] = lambda method: False
        self.calls: list[tuple[str, object]] = []
        self.refused = 0

    def wrap(self, store: Any) -> Any:
        return _Proxy(store, self)

    def check(self, method: str, args: tuple[object, ...]) -> None:
        self.calls.append((method, args[0] if args else None))
        if self.down or self.refuse(method):
            self.refused += 1
            raise StoreUnavailable("The batch lane's store is down (a test's)")


class _Proxy:
    def __init__(self, store: Any, flaky: Flaky) -> None:
        self._store, self._flaky = store, flaky

    def __getattr__(self, method: str) -> Any:
        attr = getattr(self._store, method)
        if not callable(attr) or method == "aclose":
            return attr
        if method in ("local", "answers"):  # a context manager, an async iterator: checked when made
            def made(*args: Any) -> Any:
                self._flaky.check(method, args)
                return attr(*args)
            return made

        async def call(*args: Any, **kwargs: Any) -> Any:
            self._flaky.check(method, args)
            return await attr(*args, **kwargs)
        return call


def failing_stores(monkeypatch: Any) -> dict[str, Flaky]:
    """The app's stores (as `store.backend` builds them), each part's made `Flaky`."""
    from gateway.stores import backends

    made: dict[str, Flaky] = {"files": Flaky(), "batches": Flaky()}
    real = backends.open_stores

    def open_stores(settings: Any, pools: Any) -> tuple[FileStore, BatchStore]:
        files, batches = real(settings, pools)
        return (FileStore(made["files"].wrap(files.records), made["files"].wrap(files.blobs)),
                BatchStore(made["batches"].wrap(batches.records), made["batches"].wrap(batches.blobs)))

    monkeypatch.setattr("gateway.app.open_stores", open_stores)
    return made
