"""Fair shares between keys: the order in which the waiting requests of one priority class are admitted
(`backends.admission` asks `pick`, and `ahead` for an expected wait, and says what it admitted and what
finished).

`fcfs`: arrival order. `vtc` (the default): the Virtual Token Counter of Sheng et al., "Fairness in Serving
Large Language Models" (OSDI 2024). Per key a counter of the service it has received: `input_weight` per prompt
token, counted as a request is admitted, and `output_weight` per output token, counted as the tokens come (read
when an order is decided). The next request admitted is the oldest one of the waiting key whose counter is
least. A key that joins the queue (none of its requests waiting) has its counter lifted to the least of the
other waiting keys' (none waiting: of the keys running; none running: to the counter of the key served last),
so that time away is not banked as credit: a key returning after an idle hour does not then shut the others
out until its counter catches up. Counters of idle keys (none waiting or running) are dropped past `MOST_KEYS`,
the least first: one at or under the floor loses nothing (it returns to the floor), one above it has the service
it received beyond the others' forgotten, and a flood of fresh keys cannot grow the map without bound. The paper's bound
holds: between two keys that both keep requests waiting, the service received differs by at most
2 x max(input_weight x the longest prompt, output_weight x the tokens the running requests may hold)."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Collection, Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

from gateway.settings import FairnessSettings

MOST_KEYS = 10_000  # counters kept before idle keys' are dropped (down to half of it, so a sweep is rare)


def _nothing() -> int:
    return 0


def _unread() -> tuple[int, int] | None:
    return None


@dataclass(eq=False, slots=True)
class Served:
    """One admitted request's service: its prompt's tokens, and its output's so far (a reading the generation
    keeps current). `read`: (prompt, output) tokens as the backend counted them once its answer is in (None: not
    counted), which replace the two when it finishes: a remote prompt's estimate can be fooled by its text, and
    a remote answer's pieces are not its tokens (a whole one comes as one piece)."""

    prompt: int = 0
    output: Callable[[], int] = field(default=_nothing)
    read: Callable[[], tuple[int, int] | None] = field(default=_unread)


class Waiter(Protocol):
    @property
    def key(self) -> str: ...

    @property
    def count(self) -> int: ...


W = TypeVar("W", bound=Waiter)


class FirstCome:
    """Arrival order: the first waiter of a key not passed over; nothing counted."""

    def pick(self, queue: Iterable[W], passed: Container[str], keys: int) -> W | None:
        """The waiter to admit next (None: none left but those of keys `passed` over); `keys`: at most that
        many keys wait in `queue`."""
        return next((waiter for waiter in queue if waiter.key not in passed), None)

    def ahead(self, queue: Iterable[W], key: str) -> int:
        """Engine requests admitted before a request of `key` joining `queue`, for its expected wait. Arrival
        order: every one waiting."""
        return sum(waiter.count for waiter in queue)

    def each_ahead(self, queue: Sequence[W]) -> list[int]:
        """Engine requests admitted before each waiter of `queue`."""
        return list(itertools.accumulate((waiter.count for waiter in queue), initial=0))[:-1]

    def joined(self, key: str, waiting: Collection[str], running: Collection[str]) -> None:
        """`key` has a request waiting again (none was), beside the keys `waiting` and `running`."""

    def admitted(self, key: str, served: Served, waiting: Collection[str]) -> None:
        """A request of `key` was admitted, beside the keys `waiting`."""

    def finished(self, key: str, served: Served) -> None:
        """An admitted request of `key` gave its permits back (its output is over, or it never ran)."""


class VirtualTokenCounter(FirstCome):
    def __init__(self, settings: FairnessSettings) -> None:
        self.input_weight, self.output_weight = settings.input_weight, settings.output_weight
        self._settled: dict[str, float] = {}  # per key: prompts admitted, outputs of requests finished
        self._running: dict[str, list[Served]] = {}  # per key: the admitted requests, their outputs still growing
        self._last = 0.0  # the counter of the key whose requests all finished last

    def counter(self, key: str) -> float:
        running = self._running.get(key)
        settled = self._settled.get(key, 0.0)
        if not running:
            return settled
        return settled + self.output_weight * sum(served.output() for served in running)

    def pick(self, queue: Iterable[W], passed: Container[str], keys: int) -> W | None:
        """The oldest waiter of the least served key (ties: the key whose oldest waiter came first)."""
        best: W | None = None
        least = 0.0
        seen: set[str] = set()
        for waiter in queue:
            key = waiter.key
            if key in seen:
                continue
            seen.add(key)
            if key not in passed:
                counter = self.counter(key)
                if best is None or counter < least:
                    best, least = waiter, counter
            if len(seen) == keys:  # every key waiting seen: no need to read the rest of a long queue
                break
        return best

    def ahead(self, queue: Iterable[W], key: str) -> int:
        """Keys served in turn, their counters kept level (ties: the key that came first): a request's place is
        (its key's engine requests before it, its key's arrival), and a flood waits behind itself, not every key
        behind it. (A key whose counter lags goes first for longer: the estimate is the order's steady state.)"""
        waiters, places = self._places(queue)
        joining = (sum(waiter.count for waiter in waiters if waiter.key == key),
                   next((rank for waiter, (_, rank) in zip(waiters, places, strict=True) if waiter.key == key),
                        len({waiter.key for waiter in waiters})))
        return sum(waiter.count for waiter, place in zip(waiters, places, strict=True) if place < joining)

    def each_ahead(self, queue: Sequence[W]) -> list[int]:
        waiters, places = self._places(queue)
        each, total = [0] * len(waiters), 0
        for at in sorted(range(len(waiters)), key=places.__getitem__):
            each[at], total = total, total + waiters[at].count
        return each

    @staticmethod
    def _places(queue: Iterable[W]) -> tuple[list[W], list[tuple[int, int]]]:
        """The waiters and each one's place in turn: (its key's engine requests before it, its key's rank)."""
        waiters, ranks, mine, places = list(queue), dict[str, int](), dict[str, int](), list[tuple[int, int]]()
        for waiter in waiters:
            own = mine.get(waiter.key, 0)
            places.append((own, ranks.setdefault(waiter.key, len(ranks))))
            mine[waiter.key] = own + waiter.count
        return waiters, places

    def joined(self, key: str, waiting: Collection[str], running: Collection[str]) -> None:
        others = [other for other in waiting if other != key] or [other for other in running if other != key]
        floor = min(self.counter(other) for other in others) if others else self._last
        own = self.counter(key)
        if floor > own:
            self._settled[key] = self._settled.get(key, 0.0) + floor - own
            self._bounded(waiting, key)

    def admitted(self, key: str, served: Served, waiting: Collection[str]) -> None:
        self._settled[key] = self._settled.get(key, 0.0) + self.input_weight * served.prompt
        self._running.setdefault(key, []).append(served)
        self._bounded(waiting, key)

    def _bounded(self, waiting: Collection[str], key: str) -> None:
        """Past `MOST_KEYS` counters, the idle keys' (not `key`, none waiting or running) dropped, the least first."""
        if len(self._settled) <= MOST_KEYS:
            return
        idle = [other for other in self._settled if other != key and other not in waiting and other not in self._running]
        idle.sort(key=self._settled.__getitem__)
        for other in idle[: len(self._settled) - MOST_KEYS // 2]:
            del self._settled[other]

    def finished(self, key: str, served: Served) -> None:
        running = self._running.get(key, [])
        if served in running:
            running.remove(served)
            read = served.read()
            if read is None:
                service = self.output_weight * served.output()
            else:  # the prompt was counted as admitted: the difference
                service = self.input_weight * (read[0] - served.prompt) + self.output_weight * read[1]
            self._settled[key] = self._settled.get(key, 0.0) + service
        if not running:
            self._running.pop(key, None)
            self._last = self._settled.get(key, 0.0)


def order(settings: FairnessSettings) -> FirstCome:
    """The order `settings` ask for."""
    return VirtualTokenCounter(settings) if settings.order == "vtc" else FirstCome()
