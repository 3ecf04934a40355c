"""Waiting for a condition in tests, never for a fixed time: a test polls what it waits for and
goes on as soon as it holds, on a fast machine or a loaded one. The bound is only how long to wait
before failing (a generous one: it costs nothing when the condition comes)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")

BOUND_S = 90.0
STEP_S = 0.005


def _failed(what: str, within_s: float) -> AssertionError:
    return AssertionError(f"not within {within_s:g} s: {what}")


async def until(condition: Callable[[], T], within_s: float = BOUND_S, what: str = "the condition") -> T:
    """`condition()`'s first true value (checked at once, then every few milliseconds, yielding to
    the event loop); AssertionError naming `what` after `within_s`."""
    deadline = time.monotonic() + within_s
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise _failed(what, within_s)
        await asyncio.sleep(STEP_S)
    return value


async def until_awaited(condition: Callable[[], Awaitable[T]], within_s: float = BOUND_S,
                        what: str = "the condition") -> T:
    """`until` for a condition that must be awaited (a store's call)."""
    deadline = time.monotonic() + within_s
    while not (value := await condition()):
        if time.monotonic() >= deadline:
            raise _failed(what, within_s)
        await asyncio.sleep(STEP_S)
    return value


def until_sync(condition: Callable[[], T], within_s: float = BOUND_S, what: str = "the condition",
               step_s: float = STEP_S) -> T:
    """`until` for code outside an event loop (a server in a thread, a subprocess, a file); `step_s`
    longer where one check is costly (a request to a real engine's server)."""
    deadline = time.monotonic() + within_s
    while not (value := condition()):
        if time.monotonic() >= deadline:
            raise _failed(what, within_s)
        time.sleep(step_s)
    return value
