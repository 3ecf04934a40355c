"""One request's state, as one typed object: made by the outermost layer (the access log) and
carried in the ASGI scope under `SCOPE_KEY`, filled in by the layers it passes (auth: who is
asking; rate limits: the key's policy; bodies: how to release the body's bytes; the route's
parse: its size and how to notice the client leaving), and read by the pipeline."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, MutableMapping
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import Dialect
from gateway.telemetry.record import RequestRecord
from gateway.tenancy.keys import ANONYMOUS
from gateway.tenancy.priority import Scheduled
from gateway.tenancy.quota import Charge
from gateway.tenancy.tenants import KeyPolicy

SCOPE_KEY = "gateway.request"

Gone = Callable[[], Coroutine[Any, Any, None]]  # returns when the client has gone away


def _nothing() -> None:
    return None


@dataclass(slots=True, eq=False)
class RequestContext:
    request_id: str = ""
    dialect: Dialect = "openai"  # the route's API: the shape of its errors and streams
    record: RequestRecord = field(default_factory=RequestRecord)
    key_id: str = ANONYMOUS  # safe to log: a keyed hash of the key
    tenant: str = ANONYMOUS  # stable across replicas, never logged: scopes caches, stores, sticky splits
    policy: KeyPolicy | None = None  # the key's policy (the keys file's), once the rate limits have read it
    charge: Charge | None = None  # the request's token charge, settled when it ends
    body_bytes: int = 0  # the size of the body the route parsed
    request_body: bytes = b""  # the body the route parsed: what a stream's takeover elsewhere would run again
    release_body: Callable[[], None] = _nothing  # the body's bytes leave the in-flight budget
    client_gone: Gone | None = None  # None: nobody to watch (a background run, a unit test)
    no_cache: bool = False  # the client asked for a fresh answer, not a stored one (Cache-Control: no-cache)
    no_store: bool = False  # the client asked that its answer not be stored (Cache-Control: no-store)
    deadline: float | None = None  # when the first byte is due (the event loop's clock), by the client's timeout
    gap_s: float | None = None  # the longest a stream's client waits for its next chunk, by its timeout (None: not said)
    lane: Scheduled | None = None  # a fixed place in the queues, in place of the key's (a batch line's: the lowest)

    def arrived(self) -> float:
        """When the request arrived (the access log's first look at it), on the event loop's clock: its
        deadline counts from then. A loop busy with a burst of arrivals gets to a request's handler
        seconds later, and its client's timeout does not wait for that."""
        now, arrival = asyncio.get_running_loop().time(), self.record.arrival
        return now if arrival is None else now - max(0.0, time.perf_counter() - arrival)


def context_of(scope: MutableMapping[str, Any]) -> RequestContext:
    """The request's context, made here when no layer made one yet (a route driven without the
    middleware: a unit test)."""
    context = scope.get(SCOPE_KEY)
    if context is None:
        context = scope[SCOPE_KEY] = RequestContext()
    assert isinstance(context, RequestContext)
    return context
