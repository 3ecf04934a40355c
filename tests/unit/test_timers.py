"""The one timer facility (pipeline.timers): deadlines in any order behind one loop timer."""

from __future__ import annotations

import asyncio
import contextvars

from gateway.pipeline import timers as timers_module
from gateway.pipeline.timers import COMPACT_AT, timers


async def test_deadlines_fire_in_due_order_whatever_the_order_they_were_set_in() -> None:
    loop, fired = asyncio.get_running_loop(), []
    start = loop.time()
    for delay in (0.06, 0.02, 0.04, 0.0):
        timers().at(start + delay, lambda d=delay: fired.append((d, loop.time() - start)))
    await asyncio.sleep(0.1)
    assert [d for d, _ in fired] == [0.0, 0.02, 0.04, 0.06]
    assert all(at >= d for d, at in fired)  # never before its time
    assert len(timers()) == 0


async def test_a_cancelled_deadline_never_fires_and_cancelling_twice_or_after_is_harmless() -> None:
    fired: list[str] = []
    kept = timers().later(0.01, lambda: fired.append("kept"))
    dropped = timers().later(0.005, lambda: fired.append("dropped"))
    dropped.cancel()
    dropped.cancel()
    assert len(timers()) == 1
    await asyncio.sleep(0.03)
    kept.cancel()  # after it fired
    assert fired == ["kept"]
    assert len(timers()) == 0


async def test_many_cancelled_deadlines_are_compacted_away() -> None:
    own = timers()
    set_ = [own.later(60, lambda: None) for _ in range(COMPACT_AT * 4)]
    for timer in set_[1:]:
        timer.cancel()
    assert len(own) == 1
    assert len(own._heap) < COMPACT_AT * 2
    set_[0].cancel()


async def test_callbacks_run_in_an_empty_context_and_a_failing_one_stops_no_other() -> None:
    who: contextvars.ContextVar[str] = contextvars.ContextVar("who", default="nobody")
    who.set("the request that set the loop timer")
    seen: list[str] = []

    def failing() -> None:
        raise RuntimeError("boom")

    timers().later(0.0, failing)
    timers().later(0.001, lambda: seen.append(who.get()))
    await asyncio.sleep(0.02)
    assert seen == ["nobody"]


def test_each_event_loop_has_its_own_timers() -> None:
    async def one() -> tuple[object, list[int]]:
        fired: list[int] = []
        timers().later(0.0, lambda: fired.append(1))
        await asyncio.sleep(0.01)
        return timers(), fired

    first, fired_first = asyncio.run(one())
    second, fired_second = asyncio.run(one())
    assert first is not second
    assert fired_first == fired_second == [1]
    assert timers_module._current is second
