"""Resumable streams: each stream's events, as framed on the wire, kept in a log that a client reconnecting to any
replica reads from where it left off, then live until the stream's end marker (docs/streams.md).

In Redis (the stored responses' Redis: `cache.backend` redis at `cache.redis_url`), under `<prefix>streams:<owner>:<id>`:
a Redis Stream of the events (XADD with an approximate MAXLEN, entry `0-<n+1>` for event n, trimmed to
`max_bytes` by XTRIM MINID, an expiry), `:takeover` (a hash: what a continuation elsewhere needs, written when the
stream opens), `:lease` (the writer's heartbeat, holding its fencing token, refreshed while it produces: gone without
an end marker, the producer died) and `:taker` (the token of the one reader that took a dead producer's stream over).
Every write checks the token in the same Lua script that writes: a producer whose lease lapsed (a Redis outage) and
whose stream was taken over meanwhile has its late events refused, so one stream never has two writers. In memory: a
bounded ring per stream with the same interface, for one process.

`Writer.append` queues and one task per stream writes in batches. With a log other replicas read (Redis), a stream's
event goes to its client only once it is in the log (`Writer.logged`): a taker elsewhere goes on from the text its
client had, never from less (which would number its events otherwise, and send the client some twice). A log that
fails is not waited for: the stream goes on without it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import secrets
import time
from collections import Counter, OrderedDict, deque
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

import structlog

from gateway.errors import InvalidRequest, NotFound, ServiceUnavailable
from gateway.protocol.batch_objects import Owner
from gateway.settings import CacheSettings, StreamSettings
from gateway.stores.redis import ERRORS, RedisPools
from gateway.stores.responses import owned_key
from gateway.telemetry import metrics

log = structlog.get_logger(__name__)

TAKEOVER_REQUEST_BYTES = 1 << 20  # a larger request is not kept for a takeover (its stream can still be resumed)
EVENT_BYTES = 128  # an in-memory event's own objects besides its frame: a tuple, an int, a bytes header, a deque slot


@dataclass(frozen=True, slots=True)
class Takeover:
    """What continuing a stream elsewhere needs besides its events so far (the text already sent): who asked (found
    again by `tenancy.keys.Authenticator.reidentify`, as a batch's lines are), where, and the request's body
    (empty when larger than `TAKEOVER_REQUEST_BYTES`)."""

    owner: Owner
    path: str
    request: bytes = b""
    ttl_s: float | None = None  # its events kept this long after the last (None: `streams.ttl_s`), also a taker's


@dataclass(slots=True)
class Read:
    """Events after a point: `events` (number, framed bytes), `end` the stream's end marker once it ended (None: it
    goes on), `first` the oldest number still kept."""

    events: list[tuple[int, bytes]]
    end: bytes | None
    first: int


class Log(Protocol):
    """Where the events are kept; `key` is an owner's stream (`owned_key`); `token` a writer's fencing token;
    `shared`: read by other replicas (which take a stream over when this one dies)."""

    shared: bool

    async def open(self, key: str, takeover: Takeover, token: str) -> None: ...
    # False: refused, the stream is another writer's now (fenced); `floor`: events before it are dropped (max_bytes);
    # `ttl_s`: the stream's (`Takeover.ttl_s`)
    async def append(self, key: str, token: str, events: list[tuple[int, bytes]], end: bytes | None,
                     floor: int = 0, ttl_s: float | None = None) -> bool: ...
    async def takeover(self, key: str) -> Takeover | None: ...  # None: no such stream
    async def read(self, key: str, after: int, block_s: float) -> Read: ...  # waits up to block_s for one event
    async def alive(self, key: str) -> bool: ...  # its writer's lease holds
    async def claim(self, key: str, token: str) -> bool: ...  # a dead producer's stream, this reader's alone
    async def forget(self, key: str) -> None: ...  # its events and takeover record gone: an unknown stream now
    async def aclose(self) -> None: ...


# A takeover of a stream whose producer died: given the takeover record and the events produced so far, the rest of
# the stream, framed without their `id:` (the store numbers and logs them); its last frame is the stream's end marker
# (see docs/streams.md; `apis.takeover` provides it).
Continuation = Callable[[Takeover, list[bytes]], AsyncGenerator[bytes, None]]


def not_found(stream_id: str) -> NotFound:
    return NotFound(f"Stream with id '{stream_id}' not found.", param="stream_id")


@dataclass(slots=True)
class StreamStore:
    log: Log
    settings: StreamSettings
    continuation: Continuation | None = None  # the hook a takeover plugs into
    writers: set[asyncio.Task[None]] = field(default_factory=set)
    readers: Counter[str] = field(default_factory=Counter)  # resumed streams being read, per key (`web.sse.resumed`)

    def of(self, owner: str) -> OwnedStreams:
        return OwnedStreams(self, owner)

    async def aclose(self) -> None:
        """Writers finish what they hold (bounded by their own calls), then the log closes."""
        await asyncio.gather(*self.writers, return_exceptions=True)
        await self.log.aclose()


@dataclass(slots=True, frozen=True)
class OwnedStreams:
    """One owner's streams; another owner's stream id is an unknown one (`owned_key`, as for stored responses)."""

    store: StreamStore
    owner: str

    def writer(self, stream_id: str, takeover: Takeover) -> Writer:
        writer = Writer(self.store, owned_key(self.owner, stream_id, not_found), takeover)
        self.store.writers.add(writer.task)
        writer.task.add_done_callback(self.store.writers.discard)
        return writer

    async def forget(self, stream_id: str) -> None:
        """Its events dropped (its response deleted): played again by nobody, an unknown stream from now on."""
        await self.store.log.forget(owned_key(self.owner, stream_id, not_found))

    async def replay(
        self, stream_id: str, after: int, path: str, missing: Callable[[str], NotFound], died: bytes,
        param: str,
    ) -> AsyncGenerator[bytes, None]:
        """The events after number `after` (-1: all), then the rest live, then the end marker; a producer that died
        first ends it with `died` (or the continuation). Refusals (`missing` for a stream of another owner, of another
        API, or unknown; 400 naming `param` for events no longer kept) raise before the first event is yielded."""
        log_, key = self.store.log, owned_key(self.owner, stream_id, missing)
        try:
            takeover = await log_.takeover(key)
            read = await log_.read(key, after, 0.0) if takeover is not None else None
            # an ended stream with nothing after `after`: had it that event (a resume exactly at its end)?
            beyond = (read is not None and read.end is not None and not read.events and after >= 0
                      and not (await log_.read(key, after - 1, 0.0)).events)
        except ERRORS as exc:
            _failed(exc)
            raise ServiceUnavailable("The stream log is unavailable; retry later") from exc
        if takeover is None or read is None or takeover.path != path:
            raise missing(stream_id)
        if read.first > after + 1:
            raise InvalidRequest(f"The events of stream '{stream_id}' before {read.first} are no longer kept", param)
        if beyond:
            raise InvalidRequest(f"Stream '{stream_id}' ended before event {after}", param)
        return self._played(key, takeover, after, read, died)

    async def _played(
        self, key: str, takeover: Takeover, after: int, read: Read, died: bytes,
    ) -> AsyncGenerator[bytes, None]:
        log_, block_s = self.store.log, self.store.settings.read_block_s
        loop, failing_since = asyncio.get_running_loop(), None
        while True:
            for number, event in read.events:
                yield event
                after = number
            if read.end is not None:
                yield read.end
                return
            try:
                if not read.events and not await log_.alive(key):
                    read = await log_.read(key, after, 0.0)  # the last events its producer wrote before its lease ended
                    if read.events or read.end is not None:
                        continue
                    token = secrets.token_hex(8)
                    if self.store.continuation is None or await log_.claim(key, token):
                        async for event in self._taken_over(key, takeover, after, died, token):
                            yield event
                        return
                    continue  # another reader took it over: its events come to the log under its lease
                read, failing_since = await log_.read(key, after, block_s), None
            except ERRORS as exc:  # a slow Redis' timeout, a blip: tried again for up to a lease
                _failed(exc)
                failing_since = failing_since or loop.time()
                if loop.time() - failing_since > self.store.settings.lease_s:
                    raise
                read = Read([], None, after + 1)
                await asyncio.sleep(block_s / 4)  # the behaviour: a pause before asking a failing Redis again

    async def _taken_over(
        self, key: str, takeover: Takeover, after: int, died: bytes, token: str,
    ) -> AsyncGenerator[bytes, None]:
        """The producer died before the end: the continuation's events, given everything produced so far, each
        numbered after the last one and logged (another reader of the stream follows them), or else `died`. This
        reader has claimed the stream (`Log.claim`): it is the one taker."""
        continuation = self.store.continuation
        if continuation is None:
            yield died
            return
        produced = await self.store.log.read(key, -1, 0.0)
        if produced.first > 0:  # its first events are no longer kept (max_events, max_bytes): no text to go on from
            yield died
            return
        last = produced.events[-1][0] if produced.events else -1
        writer = Writer(self.store, key, takeover, after=last, token=token)
        self.store.writers.add(writer.task)
        writer.task.add_done_callback(self.store.writers.discard)
        held: bytes | None = None  # one frame behind: the last one is the end marker
        events, ended = continuation(takeover, [event for _, event in produced.events]), False
        try:
            async for frame in events:
                if held is not None:
                    numbered = b"id: %d\n" % writer.next + held
                    writer.append(numbered)
                    if writer.next - 1 > after:
                        await writer.logged(writer.next - 1)  # a taker of this taker goes on from no less
                        yield numbered
                held = frame
            ended = True
        finally:
            await events.aclose()
            if ended:
                writer.close(held or b"")
            else:  # this reader left mid-way: what it logged stays, and the next reader takes over from there
                writer.close(None)
        yield held or b""


class Writer:
    """One stream's log, written by one task in the order of `append` (a Redis that fails stops the log, not the
    stream: its lease then lapses, and a reader is told the producer is gone)."""

    def __init__(self, store: StreamStore, key: str, takeover: Takeover, after: int = -1, token: str = "") -> None:
        """`after`: the number of the last event already logged (a takeover's writer goes on after it, under the
        `token` its claim took)."""
        self._log, self._key, self._takeover, self._opened = store.log, key, takeover, after >= 0
        self.token = token or secrets.token_hex(8)
        self._beat_s, self._max_bytes = store.settings.lease_s / 3, store.settings.max_bytes
        self._pending: list[tuple[int, bytes]] = []
        self._sizes: deque[int] = deque()  # the bytes of each event this writer appended and still keeps
        self._bytes, self._oldest = 0, after + 1  # their sum, and the number of the first of them
        self.floor = 0  # events before it are trimmed from the log (`max_bytes`); 0: none yet
        self._end: bytes | None = None
        self._closed = False
        self.next = after + 1  # the next event's number
        self._written = after  # the number of the last event in the log
        self._waits = store.log.shared  # `logged` waits for the log (else it returns at once)
        self._moved: asyncio.Future[None] | None = None  # done when `_written` moves or the log fails or stops
        self._wake = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._write())
        self.task.add_done_callback(self._stopped)  # also when cancelled before it ever ran (no `finally` then)

    def append(self, frame: bytes) -> None:
        """Queue the next event (number `next`)."""
        self._pending.append((self.next, frame))
        self._sizes.append(len(frame))
        self._bytes += len(frame)
        while self._bytes > self._max_bytes and len(self._sizes) > 1:  # the newest is kept, whatever its size
            self._bytes -= self._sizes.popleft()
            self._oldest += 1
            self.floor = self._oldest
        self.next += 1
        self._wake.set()

    async def logged(self, number: int) -> None:
        """Returns once event `number` is in a shared log; at once with a log of this process (nobody else takes the
        stream over), while the log fails (its calls are being tried again) or once this writer stopped."""
        while self._waits and self._written < number:
            if self._moved is None or self._moved.done():
                self._moved = asyncio.get_running_loop().create_future()
            await self._moved

    def _signal(self) -> None:
        if self._moved is not None and not self._moved.done():
            self._moved.set_result(None)

    def close(self, end: bytes | None) -> None:
        """The stream's end marker; None: stopped without one (a shutdown's cancel): what was queued is written, then
        the lease lapses and a reader takes the producer for gone, as when its replica dies."""
        self._end, self._closed = end, True
        self._wake.set()

    def _stopped(self, _: asyncio.Task[None]) -> None:
        self._waits = False  # stopped: nobody waits for a log that takes no more
        self._signal()

    async def _write(self) -> None:
        """Each call tried again (a slow Redis' timeout, a blip) until it has failed for a whole lease: then the
        readers take the producer for gone, and the log stops."""
        if not self._opened and not await self._tried(functools.partial(self._log.open, self._key, self._takeover,
                                                                         self.token)):
            return
        while True:
            with contextlib.suppress(TimeoutError):  # woken by an event, or to renew the lease
                await asyncio.wait_for(self._wake.wait(), self._beat_s)
            self._wake.clear()
            events, end, closed, fenced = list(self._pending), self._end, self._closed, False

            async def append(events: list[tuple[int, bytes]] = events, end: bytes | None = end) -> None:
                nonlocal fenced
                fenced = not await self._log.append(self._key, self.token, events, end, self.floor,
                                                    self._takeover.ttl_s)

            if not await self._tried(append):
                return
            if fenced:  # taken over while this writer's lease lapsed: the log is the taker's now
                log.warning("stream_log_fenced", key=self._key)
                return
            del self._pending[: len(events)]  # written (events appended meanwhile stay)
            if events:
                self._written = events[-1][0]
                self._signal()
            if closed:
                return

    async def _tried(self, call: Callable[[], Awaitable[None]]) -> bool:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + self._beat_s * 3
        while True:
            try:
                await call()
                self._waits = self._log.shared  # the log works again: its events are waited for again
                return True
            except ERRORS as exc:
                _failed(exc)
                self._waits = False  # failing: the stream goes on without waiting for it
                self._signal()
                if loop.time() >= give_up:
                    return False
            await asyncio.sleep(self._beat_s / 4)  # the behaviour: a pause before trying Redis again


def _failed(exc: BaseException) -> None:
    metrics.labelled(metrics.CACHE_ERRORS, "redis").inc()
    log.warning("stream_log_unavailable", error=str(exc))


class MemoryLog:
    """Rings in this process: `max_events` and `max_bytes` per stream, streams kept `ttl_s` after their last write,
    at most `max_streams` and `memory_bytes` in all (the oldest dropped first). A ring's bytes count its frames plus
    `EVENT_BYTES` per event (the entry's tuple, int and bytes objects)."""

    shared = False  # a stream's producer and its takers are in this process: a queued event is logged all the same

    def __init__(self, settings: StreamSettings) -> None:
        self.settings = settings
        self._rings: OrderedDict[str, _Ring] = OrderedDict()
        self.bytes = 0  # of every ring

    def _ring(self, key: str) -> _Ring | None:
        ring = self._rings.get(key)
        if ring is not None and ring.expires < time.monotonic():
            self._drop(key)
            return None
        return ring

    def _drop(self, key: str) -> None:
        self.bytes -= self._rings.pop(key).size

    async def open(self, key: str, takeover: Takeover, token: str) -> None:
        if key in self._rings:
            self._drop(key)
        self._rings[key] = _Ring(takeover, deque(), token=token, size=len(takeover.request) + EVENT_BYTES,
                                 ttl_s=takeover.ttl_s or self.settings.ttl_s)
        self.bytes += self._rings[key].size
        self._touch(key, self._rings[key])
        self._bound()

    def _bound(self) -> None:
        while len(self._rings) > self.settings.max_streams or (self.bytes > self.settings.memory_bytes and
                                                                len(self._rings) > 1):
            self._drop(next(iter(self._rings)))

    async def append(self, key: str, token: str, events: list[tuple[int, bytes]], end: bytes | None,
                     floor: int = 0, ttl_s: float | None = None) -> bool:
        ring = self._ring(key)
        if ring is None:
            return True  # dropped: nothing to keep it in
        if ring.token != token:
            return False
        ring.events.extend(events)
        added = sum(len(frame) + EVENT_BYTES for _, frame in events) + (len(end) if end else 0)
        ring.size += added
        self.bytes += added
        while ring.events and (ring.events[0][0] < floor or len(ring.events) > self.settings.max_events):
            dropped = len(ring.events.popleft()[1]) + EVENT_BYTES
            ring.size -= dropped
            self.bytes -= dropped
        ring.end = end
        self._touch(key, ring)
        ring.changed.set()
        ring.changed = asyncio.Event()
        self._bound()
        return True

    def _touch(self, key: str, ring: _Ring) -> None:
        now = time.monotonic()
        ring.expires, ring.lease = now + ring.ttl_s, now + self.settings.lease_s
        self._rings.move_to_end(key)

    async def takeover(self, key: str) -> Takeover | None:
        ring = self._ring(key)
        return None if ring is None else ring.takeover

    async def read(self, key: str, after: int, block_s: float) -> Read:
        ring = self._ring(key)
        if ring is None:
            return Read([], b"", 0)  # dropped while read: ended
        if block_s and ring.end is None and (not ring.events or ring.events[-1][0] <= after):
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ring.changed.wait(), block_s)
        first = ring.events[0][0] if ring.events else 0
        return Read([event for event in ring.events if event[0] > after], ring.end, first)

    async def alive(self, key: str) -> bool:
        ring = self._ring(key)
        return ring is not None and ring.lease >= time.monotonic()

    async def claim(self, key: str, token: str) -> bool:
        ring = self._ring(key)
        if ring is None or ring.lease >= time.monotonic():
            return False
        ring.lease = time.monotonic() + self.settings.lease_s  # the taker's lease, renewed as it writes
        ring.token = token  # the producer's late events refused from now on
        return True

    async def forget(self, key: str) -> None:
        if key in self._rings:
            self._drop(key)

    async def aclose(self) -> None:
        self._rings.clear()


@dataclass(slots=True)
class _Ring:
    takeover: Takeover
    events: deque[tuple[int, bytes]]
    token: str = ""  # its writer's (fencing)
    size: int = 0  # its frames' and request's bytes, and EVENT_BYTES per event
    ttl_s: float = 0.0
    end: bytes | None = None
    expires: float = 0.0
    lease: float = 0.0
    changed: asyncio.Event = field(default_factory=asyncio.Event)


def _entry(number: int) -> str:
    return f"0-{number + 1}"  # explicit ids: XRANGE and XREAD after event n are after 0-<n+1>


def _number(entry_id: bytes) -> int:
    """An event's number from its entry's id (the end marker's, a time, counts as before every event)."""
    time_part, _, sequence = entry_id.partition(b"-")
    return int(sequence) - 1 if time_part == b"0" else -1


# A writer's batch (or its lease's renewal, which renews the expiry too: a stream kept briefly that sends nothing
# for a while lives on), fenced: refused (0) when the lease holds another writer's token, or lapsed and the stream was
# claimed by another (`:taker`). An event a try that timed out wrote already is kept as it was (XADD's error on an id
# not above the last, ignored).
# KEYS: the stream, :lease, :takeover, :taker. ARGV: token, lease ms, ttl ms, max events, floor entry ('': none),
# ended ('1'), end marker, then each event's entry id and frame.
_APPEND = """
if redis.replicate_commands then redis.replicate_commands() end
local held = redis.call('GET', KEYS[2])
if held then
  if held ~= ARGV[1] then return 0 end
else
  local taker = redis.call('GET', KEYS[4])
  if taker and taker ~= ARGV[1] then return 0 end
end
for i = 8, #ARGV, 2 do
  redis.pcall('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], ARGV[i], 'e', ARGV[i + 1])
end
if ARGV[5] ~= '' then redis.call('XTRIM', KEYS[1], 'MINID', ARGV[5]) end
if ARGV[6] == '1' then
  redis.call('XADD', KEYS[1], 'MAXLEN', '~', ARGV[4], '*', 'end', ARGV[7])
  redis.call('DEL', KEYS[2])
else
  redis.call('SET', KEYS[2], ARGV[1], 'PX', ARGV[2])
end
redis.call('PEXPIRE', KEYS[1], ARGV[3])
redis.call('PEXPIRE', KEYS[3], ARGV[3])
return 1
"""
# One taker of a stream whose lease lapsed: `:taker` set if absent (expiring with a lease: a taker that dies too
# leaves the stream to the next reader), then the lease under its token. KEYS: :lease, :taker. ARGV: token, lease ms.
_CLAIM = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
if not redis.call('SET', KEYS[2], ARGV[1], 'NX', 'PX', ARGV[2]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
return 1
"""


class RedisLog:
    """The Redis layout in the module's docstring; every call bounded by `cache.redis_timeout_s`."""

    shared = True

    def __init__(self, pools: RedisPools, url: str, prefix: str, timeout_s: float, settings: StreamSettings) -> None:
        self._client = pools.client(url, timeout_s)
        self.prefix, self.settings = prefix, settings
        self._append = self._client.redis.register_script(_APPEND)
        self._claim = self._client.redis.register_script(_CLAIM)

    async def open(self, key: str, takeover: Takeover, token: str) -> None:
        fields = {"key_id": takeover.owner.key_id, "tenant": takeover.owner.tenant, "path": takeover.path,
                  "request": takeover.request, "ttl_s": str(takeover.ttl_s or 0)}
        ttl_ms, base = int((takeover.ttl_s or self.settings.ttl_s) * 1000), self.prefix + key
        async with self._client.redis.pipeline(transaction=False) as pipe:
            pipe.hset(base + ":takeover", mapping=fields)  # type: ignore[arg-type]
            pipe.pexpire(base + ":takeover", ttl_ms)
            pipe.set(base + ":lease", token, px=int(self.settings.lease_s * 1000))
            await self._client.bounded(pipe.execute())

    async def append(self, key: str, token: str, events: list[tuple[int, bytes]], end: bytes | None,
                     floor: int = 0, ttl_s: float | None = None) -> bool:
        base, settings = self.prefix + key, self.settings
        args: list[str | bytes | int] = [
            token, int(settings.lease_s * 1000), int((ttl_s or settings.ttl_s) * 1000), settings.max_events,
            _entry(floor) if floor else "", "1" if end is not None else "0", end or b"",
        ]
        for number, frame in events:
            args += [_entry(number), frame]
        keys = [base, base + ":lease", base + ":takeover", base + ":taker"]
        return bool(await self._client.bounded(self._append(keys=keys, args=args)))

    async def takeover(self, key: str) -> Takeover | None:
        raw = await self._client.bounded(self._client.redis.hgetall(self.prefix + key + ":takeover"))
        found = cast(dict[bytes, bytes], raw)
        if not found:
            return None
        owner = Owner(key_id=found[b"key_id"].decode(), tenant=found[b"tenant"].decode())
        ttl_s = float(found.get(b"ttl_s", b"0")) or None  # 0: the settings'
        return Takeover(owner, found[b"path"].decode(), found.get(b"request", b""), ttl_s)

    async def read(self, key: str, after: int, block_s: float) -> Read:
        redis, base = self._client.redis, self.prefix + key
        entries: list[tuple[bytes, dict[bytes, bytes]]]
        if block_s:  # within the call's own bound
            block_ms = max(1, int(min(block_s, self._client.timeout_s / 2) * 1000))
            found = cast(list[Any], await self._client.bounded(redis.xread({base: _entry(after)}, block=block_ms)))
            entries = found[0][1] if found else []  # RESP2: [[stream, entries]]
            first = after + 1
        else:
            async with redis.pipeline(transaction=False) as pipe:
                pipe.xrange(base, min=_entry(after + 1))
                pipe.xrange(base, count=1)
                entries, oldest = await self._client.bounded(pipe.execute())
            first = _number(oldest[0][0]) if oldest else 0
        events: list[tuple[int, bytes]] = []
        end: bytes | None = None
        for entry_id, fields in entries:
            if b"end" in fields:
                end = fields[b"end"]
                break
            events.append((_number(entry_id), fields[b"e"]))
        return Read(events, end, first)

    async def alive(self, key: str) -> bool:
        return bool(await self._client.bounded(self._client.redis.exists(self.prefix + key + ":lease")))

    async def claim(self, key: str, token: str) -> bool:
        """One taker (`_CLAIM`); readers that lost wait on the log."""
        base = self.prefix + key
        keys, args = [base + ":lease", base + ":taker"], [token, str(int(self.settings.lease_s * 1000))]
        return bool(await self._client.bounded(self._claim(keys=keys, args=args)))

    async def forget(self, key: str) -> None:
        """The stream and its takeover record (a producer still writing appends to a stream no reader finds)."""
        base = self.prefix + key
        await self._client.bounded(self._client.redis.delete(base, base + ":takeover"))

    async def aclose(self) -> None:
        pass  # the pool is the app's (stores.redis)


def in_memory(settings: StreamSettings | None = None) -> StreamStore:
    settings = settings or StreamSettings()
    return StreamStore(MemoryLog(settings), settings)


def make_stream_store(cache: CacheSettings, settings: StreamSettings, pools: RedisPools) -> StreamStore:
    """In the stored responses' Redis when they are in Redis (replicas share it), else in this process."""
    if cache.backend == "redis" and cache.redis_url:
        prefix = cache.redis_prefix + "streams:"
        return StreamStore(RedisLog(pools, cache.redis_url, prefix, cache.redis_timeout_s, settings), settings)
    return in_memory(settings)

