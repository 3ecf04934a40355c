"""Large inputs are prepared (chat template, tokenizing) off the event loop, in one worker thread:
tokenizing a large body inline would stall every stream in progress, and the Rust tokenizers
release the GIL. Small inputs stay inline, where a thread hop costs more than they do; large ones
queue behind each other instead of taking every core (figures: benchmarks/RESULTS.md).
"""

from __future__ import annotations

import asyncio
import contextvars
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")

INLINE_MAX_BYTES = 16 * 1024  # request bodies up to this are prepared on the event loop
_WORKER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")


def inline(size: int) -> bool:
    """Whether a request body of `size` bytes is prepared on the event loop (`by_size` calls its
    function directly then: a caller on the hot path can too, without awaiting a coroutine)."""
    return size <= INLINE_MAX_BYTES


async def by_size(size: int, fn: Callable[..., T], *args: object) -> T:
    """fn(*args), inline for a request body of `size` bytes up to INLINE_MAX_BYTES, else in the
    worker thread (with this request's context: its log fields and record)."""
    if inline(size):
        return fn(*args)
    context = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(_WORKER, context.run, fn, *args)
