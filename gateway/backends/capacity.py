"""A model's measured capacity, for admission: how long an engine request holds its permit, how
long each of its output tokens takes, and the concurrency limit those set.

Fed only by admission: a permit taken and given back, with the output tokens its answer counted.
The limit follows the gradient rule of Envoy's adaptive concurrency and Netflix's concurrency-limits,
on the time per output token rather than a round trip (an answer's length is the client's, its pace
the engine's): once per window of half the limit's answers, their pace against the engine's
unloaded pace (the lightest seen). While it stays within `TOLERANCE` of it the limit grows by its
square root (the queue it allows the engine); past it the limit shrinks in proportion, to at most
half. An engine batches more requests at a slower pace each: the limit settles where adding
requests costs more in pace than it brings in tokens per second, which fixed bounds cannot know for
a model, a prompt mix or a machine. `bound` (`max_running`) stays a hard cap; with the rule off the
limit is the bound. It starts at a quarter of the engine's batch (its max_num_seqs; `INITIAL` at
least) and, as TCP's slow start, doubles each window until the pace first leaves the tolerance: a
flood met cold reaches the engine's batch in a few windows, not in dozens of square-root steps, and
has a share of it running while a busy event loop takes the rest in.

A stream is answered at its first token, and its client then waits for each next one at most its
read timeout (`X-Stainless-Read-Timeout`: httpx's read timeout runs per read): it needs the engine
to start it in time and to keep its gaps short, not the pace of a lightly loaded engine. An answer
brings that bound (`gap_s`) with it; a window of streams only holds the pace to `GAP_SHARE` of
their shortest bound (the engine's `TOLERANCE` at least: a client's short timeout does not shrink the
limit for the others) and, while within it, the limit goes at
once to the gradient's projection (the limit times the room: an engine's time per token grows at
most in proportion to its batch), up to the engine's batch: past it the engine only queues them.
A cold flood of streams reaches the batch in one window, while the first wave's deadline has
room for a second. One whole answer in a window holds it to the engine's pace. The same rule, the
same limit; only the pace each answer needs differs. A stream's first token is its first gap, and
it comes long before its answer ends (a stream holds its permit for its whole generation): a window
of half the limit's first tokens, the limit held full, within `GAP_SHARE` of their shortest bound,
takes the limit to the same projection at once (`started`). Only up: a slow first token says
nothing the answers' windows do not, so a client's short read timeout lowers nothing; without it a
low start (or a limit whole answers left low) would grow only once the first wave of streams ended.

The expected wait of a queue position (Little's law: `limit` requests each held `service` seconds)
and the Retry-After of a refusal read the engine's own time per request when it reports one
(`engine_s`: its queue, prefill and decode on its own clock), else the average time a permit is
held. A permit's time also holds the gateway's intake and delivery, which a burst of arrivals
stretches on a busy event loop for the first answers only: measured so, every waiter of a cold
flood would look too far back to be served. A stream's expected wait adds the engine's time to a
first token (its queue and prefill), when it reports one: the stream is answered then. With the limit
past the engine's batch (whole answers may take it there) the engine queues the rest, and its times
hold that queue, the recent answers' (those that queued) most: a stream's wait then runs at the
batch freed each time between the two (its decode), the queue left out of the rate.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

TOLERANCE = 4.0  # how much slower than the engine's unloaded pace its pace may become before the limit shrinks
SMOOTHING = 0.5  # how far one window moves the limit toward the rule's
SHORT = 2 / (10 + 1)  # the weight of an answer in the average time a permit is held: over about 10
RELEARN = 0.05  # how fast the unloaded pace rises when the pace stays far above it (longer prompts, another mix)
INITIAL = 8  # the limit before anything is measured, at least
OF_BATCH = 4  # ... and at most this share of the engine's batch (max_num_seqs): two doublings to it
MOST_RETRY_S = 3600
GAP_SHARE = 0.25  # the share of a stream's read timeout the engine's time per token may take: well under it


class Capacity:
    def __init__(self, bound: int, adaptive: bool = True, clock: Callable[[], float] = time.monotonic,
                 engine_s: Callable[[], float | None] | None = None, batch: int = 0,
                 first_token_s: Callable[[], float | None] | None = None) -> None:
        """`engine_s` reads the engine's time per request (`EngineLoad.request_s`; None: none yet),
        `first_token_s` its time to a first token (`EngineLoad.first_token_s`); `batch`: the most
        requests the engine runs at once (0: not known), which the start is a share of and streams' limit."""
        self.bound = bound
        self.batch = batch
        self.first_token_s = first_token_s
        self.adaptive = adaptive
        self.clock = clock
        self.engine_s = engine_s
        self._limit = float(min(bound, max(INITIAL, batch // OF_BATCH)) if adaptive else bound)
        self._starting = adaptive  # slow start: doubling, until the pace first leaves the tolerance
        self.service_s: float | None = None  # average time a permit is held, over recent answers
        self.unloaded: float | None = None  # seconds per output token at the lightest load seen: the pace to hold
        self._window = [0, 0.0, 0, 0]  # answers, seconds held, output tokens, busy answers: since the last update
        self._gap_s = math.inf  # the shortest gap bound of the window's streams (None, a whole answer: 0, the engine's pace)
        self._first = [0, 0.0, 0, math.inf]  # streams' first tokens: count, seconds to them, busy, shortest gap bound

    @property
    def limit(self) -> int:
        return max(1, int(self._limit))

    def finished(self, held_s: float, tokens: int | None, running: int, gap_s: float | None = None) -> bool:
        """A permit given back after `held_s`; `tokens`: its answer's output tokens (None: it failed
        or was cancelled, which says nothing of the engine's pace). `running`: requests admitted
        while it ran, counting it; `gap_s`: a stream's, the longest its client waits for a next token
        (None: a whole answer). The limit moves once a window of half its answers is in: then True."""
        if tokens is None or not 0 <= held_s < math.inf:
            return False
        self.service_s = held_s if self.service_s is None else self.service_s + SHORT * (held_s - self.service_s)
        window = self._window
        window[0] += 1
        window[1] += held_s
        window[2] += max(1, tokens)
        window[3] += running >= self._limit / 2  # the limit held requests back: the pace says something of it
        self._gap_s = min(self._gap_s, 0.0 if gap_s is None else gap_s)
        if window[0] * 2 < self.limit:  # half the limit's answers: the pace at this limit, and soon
            return False
        engine_s = None if self.engine_s is None else self.engine_s()
        held = window[1] if engine_s is None else min(window[1], engine_s * window[0])  # its intake left out
        pace, busy, gap_s = held / window[2], window[3] * 2 > window[0], self._gap_s
        self._window, self._gap_s = [0, 0.0, 0, 0], math.inf
        if not 0 < pace < math.inf:  # answers in no time by the clock (its grain, a fake one): no pace to hold
            return True
        if self.unloaded is None or pace < self.unloaded:
            self.unloaded = pace
        if self.adaptive and busy:
            self._adapt(pace, self.unloaded, gap_s)
        return True

    def started(self, first_s: float, running: int, gap_s: float) -> bool:
        """A stream's first token, `first_s` after its permit was taken; `running`: requests admitted
        meanwhile, counting it; `gap_s`: the longest its client waits for a token. Once half the limit's
        first tokens are in, held full, well within their shortest bound (`GAP_SHARE`): the limit goes
        to the gradient's projection, up to the engine's batch, and True (a window closed)."""
        if not self.adaptive or not 0 <= first_s < math.inf:
            return False
        window = self._first
        window[0] += 1
        window[1] += first_s
        window[2] += running >= self._limit / 2
        window[3] = min(window[3], gap_s)
        if window[0] * 2 < self.limit:
            return False
        reported = None if self.first_token_s is None else self.first_token_s()
        took = window[1] if reported is None else min(window[1], reported * window[0])  # its intake left out
        first, busy, target = took / window[0], window[2] * 2 > window[0], GAP_SHARE * window[3]
        self._first = [0, 0.0, 0, math.inf]
        if busy and 0 < first < target:  # (0: no time by the clock's grain, no measure to project from)
            self._limit = max(self._limit, min(self._streams_ceiling, self._limit * target / first))
        return True

    def _adapt(self, pace: float, unloaded: float, gap_s: float) -> None:
        """`gap_s`: the shortest gap bound of the window's streams (0: a whole answer among them)."""
        target, ceiling = TOLERANCE * unloaded, float(self.bound)
        if gap_s > 0:  # streams only: their bound, not the engine's best pace; up to the batch, past which it queues
            target = max(target, GAP_SHARE * gap_s)  # (never below: a client's header cannot shrink the others' limit)
            ceiling = max(self._limit, self._streams_ceiling)
        gradient = target / pace
        if gap_s > 0 and gradient >= 1.0:  # streams with room: the pace projected in proportion to the limit
            self._limit = min(ceiling, self._limit * gradient)
            return
        if self._starting and gradient >= 2.0:  # room for the pace to double, as it may with the batch
            self._limit = min(ceiling, 2 * self._limit)
            return
        self._starting = False
        if gradient < 0.5:  # far slower than ever at any load: the work has changed, the pace to hold with it
            self.unloaded = unloaded + RELEARN * (pace - unloaded)
        gradient = max(0.5, min(1.0, gradient))
        wanted = self._limit * gradient + math.sqrt(self._limit)
        self._limit = min(ceiling, max(1.0, self._limit + SMOOTHING * (wanted - self._limit)))

    @property
    def _streams_ceiling(self) -> float:
        """Streams' limit at most: the engine's batch (past it the engine only queues them), within the bound."""
        return float(min(self.bound, self.batch or self.bound))

    @property
    def service(self) -> float | None:
        """Seconds a request holds its place: the engine's time per request, else a permit's (None:
        nothing measured yet)."""
        engine_s = None if self.engine_s is None else self.engine_s()
        return self.service_s if engine_s is None else engine_s

    def expected_wait(self, ahead: int, stream: bool = False) -> float | None:
        """Seconds until `ahead` engine requests have been admitted, at the measured rate (None:
        nothing measured yet); a `stream`'s, until its first token (the engine's time to one added).
        While the limit starts (doubling) it is a probe, not the engine's measure: the rate is the
        bound's, so a cold flood is not refused for a limit it will outgrow."""
        service = self.service
        if service is None:
            return None
        first = (self.first_token_s() if stream and self.first_token_s is not None else None) or 0.0
        limit = self.bound if self._starting else self.limit
        if first and 0 < self.batch < limit:  # past its batch the engine queues them, on the clock of its time per request
            return ahead * max(0.0, service - first) / self.batch + first  # (its queue left out: the batch frees as it decodes)
        return ahead * service / limit + first

    def retry_after(self, ahead: int, least: int) -> int:
        """Seconds until a queue of `ahead` is served, at least `least` (the setting) and 1 (0 would
        invite the retry at once), the measure at most `MOST_RETRY_S` (an engine's wild report)."""
        wait = self.expected_wait(ahead)
        measured = 0 if wait is None else math.ceil(min(MOST_RETRY_S, wait))  # (min: NaN and inf read as the most)
        return max(1, least, measured)
