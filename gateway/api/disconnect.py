"""Noticing that a client went away, so that its engine request is aborted at once."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

from starlette.types import Receive

from gateway.context import current_record
from gateway.errors import ClientDisconnected

T = TypeVar("T")


async def wait_for_disconnect(receive: Receive) -> None:
    """Return when the client disconnects (call it after the request body has been read)."""
    while (await receive())["type"] != "http.disconnect":
        pass


async def unless_disconnected(receive: Receive, work: Awaitable[T]) -> T:
    """Await `work`; if the client goes first, cancel it (aborting its engine request) and raise."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(wait_for_disconnect(receive))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if task in done:
            return task.result()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        current_record().disconnected = True
        raise ClientDisconnected()
    finally:
        watcher.cancel()
        task.cancel()
