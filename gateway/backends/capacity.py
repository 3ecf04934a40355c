"""A model's measured capacity, for admission: how long an engine request holds its permit, how
long each of its output tokens takes, and the concurrency limit those set.

Fed only by admission: a permit taken and given back, with the output tokens its answer counted.
The limit follows the gradient rule of Netflix's concurrency-limits (Gradient2), on the time per
output token rather than a round trip (an answer's length is the client's, its pace is the engine's):
a short average of that time against a long one. While the short stays within `TOLERANCE` of the
long the limit grows by its square root (the queue it allows the engine); past it the limit shrinks
in proportion, to at most half, and the long average drifts down when load has gone. An engine
batches more requests at a slower pace each: the limit settles where adding requests stops paying
in tokens per second, which fixed bounds cannot know for a model, a prompt mix or a machine.
`bound` (`max_running`) stays a hard cap; with the rule off the limit is the bound.

The same averages give the expected wait of a queue position (Little's law: `limit` requests each
holding a permit `service_s`) and the Retry-After of a refusal.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

TOLERANCE = 1.5  # how much slower the short average may be than the long before the limit shrinks
SMOOTHING = 0.2  # how far one sample moves the limit toward the rule's
SHORT, LONG = 2 / (10 + 1), 2 / (500 + 1)  # the averages' weights: over about 10 and 500 samples
INITIAL = 8  # the limit before anything is measured
MOST_RETRY_S = 3600


class Capacity:
    def __init__(self, bound: int, adaptive: bool = True, clock: Callable[[], float] = time.monotonic) -> None:
        self.bound = bound
        self.adaptive = adaptive
        self.clock = clock
        self._limit = float(min(bound, INITIAL) if adaptive else bound)
        self.service_s: float | None = None  # average time a permit is held, over recent answers
        self._short: float | None = None  # seconds per output token, recent
        self._long: float | None = None  # the same, over a long run: the pace to hold

    @property
    def limit(self) -> int:
        return max(1, int(self._limit))

    def finished(self, held_s: float, tokens: int | None, running: int) -> None:
        """A permit given back after `held_s`; `tokens`: its answer's output tokens (None: it failed
        or was cancelled, which says nothing of the engine's pace). `running`: requests admitted
        while it ran, counting it."""
        if tokens is None or held_s < 0:
            return
        self.service_s = held_s if self.service_s is None else self.service_s + SHORT * (held_s - self.service_s)
        pace = held_s / max(1, tokens)
        if self._short is None or self._long is None:
            self._short = self._long = pace
        else:
            self._short += SHORT * (pace - self._short)
            self._long += LONG * (pace - self._long)
        if self.adaptive:
            self._adapt(running)

    def _adapt(self, running: int) -> None:
        assert self._short is not None
        assert self._long is not None
        if self._long > 2 * self._short:  # load has gone: the pace to hold drifts toward the present one
            self._long *= 0.95
        if running < self._limit / 2:  # the limit was not what held requests back: nothing learned of it
            return
        gradient = max(0.5, min(1.0, TOLERANCE * self._long / self._short))
        wanted = self._limit * gradient + math.sqrt(self._limit)
        self._limit = min(float(self.bound), max(1.0, self._limit + SMOOTHING * (wanted - self._limit)))

    def expected_wait(self, ahead: int) -> float | None:
        """Seconds until `ahead` engine requests have been admitted, at the measured rate (None:
        nothing measured yet)."""
        if self.service_s is None:
            return None
        return ahead * self.service_s / self.limit

    def retry_after(self, ahead: int, least: int) -> int:
        """Seconds until a queue of `ahead` is served, at least `least` (the setting)."""
        wait = self.expected_wait(ahead)
        return least if wait is None else max(least, min(MOST_RETRY_S, math.ceil(wait)))
