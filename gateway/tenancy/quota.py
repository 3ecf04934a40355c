"""Rate limits and token budgets per API key: in Redis where every replica sees them, in process when Redis is absent
or down."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime, timedelta

import structlog

from gateway.errors import OverTokenLimit, QuotaExceeded, RateLimited
from gateway.settings import LimitsSettings
from gateway.stores.redis import ERRORS, RedisPools
from gateway.telemetry import metrics
from gateway.tenancy.limits import TokenBucket, duration
from gateway.tenancy.tenants import KeyPolicy

log = structlog.get_logger(__name__)

# A token bucket refilled at `capacity` a minute. `force`: take even past empty (a debt later
# requests wait out) or give back (a negative amount): a settled estimate.
BUCKET_LUA = """
local capacity = tonumber(ARGV[1])
local amount = tonumber(ARGV[2])
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'tokens', 'at')
local tokens = tonumber(state[1]) or capacity
local at = tonumber(state[2]) or now
tokens = math.min(capacity, tokens + math.max(0, now - at) * capacity / 60)
local allowed = 0
if ARGV[3] == '1' or amount <= tokens then
  tokens = math.min(capacity, tokens - amount)
  allowed = 1
end
redis.call('HSET', KEYS[1], 'tokens', tostring(tokens), 'at', tostring(now))
redis.call('PEXPIRE', KEYS[1], math.ceil((capacity - tokens) * 60000 / capacity) + 1000)
return {allowed, tostring(tokens)}
"""

# Reserve `amount` in every period's counter, or in none: the first period it does not fit in
# (1-based) and what that period has used.
RESERVE_LUA = """
local amount = tonumber(ARGV[1])
local n = #KEYS
for i = 1, n do
  local used = tonumber(redis.call('GET', KEYS[i]) or '0')
  if used + amount > tonumber(ARGV[1 + i]) then
    return {i, used}
  end
end
for i = 1, n do
  redis.call('INCRBY', KEYS[i], amount)
  redis.call('EXPIRE', KEYS[i], tonumber(ARGV[1 + n + i]))
end
return {0, 0}
"""


@dataclass(frozen=True, slots=True)
class Period:
    name: str  # "day" or "month"
    counter: str
    limit: int
    renews: datetime

    def ttl_s(self) -> int:
        """The counter outlives its period by a day (settlements of requests that straddle the end)."""
        return int((self.renews - datetime.now(UTC)).total_seconds()) + 86400


def periods(policy: KeyPolicy, now: datetime | None = None) -> list[Period]:
    if policy.budget_day is None and policy.budget_month is None:
        return []  # no budget (nearly always): no clock read
    now = now or datetime.now(UTC)
    found = []
    if policy.budget_day is not None:
        day = now.replace(hour=0, minute=0, second=0, microsecond=0)
        counter = f"budget:{policy.key_id}:day:{day:%Y-%m-%d}"
        found.append(Period("day", counter, policy.budget_day, day + timedelta(days=1)))
    if policy.budget_month is not None:
        month = now.replace(day=1, hour=0, minute=0, second=0, microsecond=0)
        renews = (month + timedelta(days=32)).replace(day=1)
        found.append(Period("month", f"budget:{policy.key_id}:month:{month:%Y-%m}", policy.budget_month, renews))
    return found


class LocalCounts:
    """In this process: when no Redis is configured, and while it is down. Counts the same way as the Redis scripts
    (token buckets, not the `limits` package's windows), so degrading changes where a key is counted, not how."""

    def __init__(self) -> None:
        self._buckets: dict[str, TokenBucket] = {}
        self._used: dict[str, tuple[float, int]] = {}  # counter → (expires, tokens used)

    def bucket(self, name: str, capacity: int, amount: float, force: bool) -> tuple[bool, float]:
        bucket = self._buckets.get(name)
        if bucket is None or bucket.capacity != capacity:  # new, or its limit changed (keys file reloaded)
            bucket = self._buckets[name] = TokenBucket(float(capacity))
        if force:
            bucket.take(0)  # refilled to now
            bucket.tokens = min(bucket.capacity, bucket.tokens - amount)
            return True, bucket.tokens
        return bucket.take(amount), bucket.tokens

    def reserve(self, found: list[Period], amount: int) -> tuple[int, int]:
        now = time.monotonic()
        self._used = {name: item for name, item in self._used.items() if item[0] > now}
        for index, period in enumerate(found, start=1):
            used = self._used.get(period.counter, (0.0, 0))[1]
            if used + amount > period.limit:
                return index, used
        self.adjust(found, amount)
        return 0, 0

    def adjust(self, found: list[Period], amount: int) -> None:
        for period in found:
            used = self._used.get(period.counter, (0.0, 0))[1]
            self._used[period.counter] = (time.monotonic() + period.ttl_s(), used + amount)


class RedisCounts:
    def __init__(self, settings: LimitsSettings, pools: RedisPools) -> None:
        assert settings.redis_url is not None
        self.prefix = settings.redis_prefix
        self._client = pools.client(settings.redis_url, settings.redis_timeout_s)
        self._bucket = self._client.redis.register_script(BUCKET_LUA)
        self._reserve = self._client.redis.register_script(RESERVE_LUA)

    async def bucket(self, name: str, capacity: int, amount: float, force: bool) -> tuple[bool, float]:
        call = self._bucket(keys=[self.prefix + name], args=[capacity, amount, int(force)])
        allowed, tokens = await self._client.bounded(call)
        return bool(allowed), float(tokens)

    async def reserve(self, found: list[Period], amount: int) -> tuple[int, int]:
        keys = [self.prefix + p.counter for p in found]
        args = [amount, *(p.limit for p in found), *(p.ttl_s() for p in found)]
        index, used = await self._client.bounded(self._reserve(keys=keys, args=args))
        return int(index), int(used)

    async def adjust(self, found: list[Period], amount: int) -> None:
        async with self._client.redis.pipeline(transaction=True) as pipe:
            for period in found:
                pipe.incrby(self.prefix + period.counter, amount)
                pipe.expire(self.prefix + period.counter, period.ttl_s())
            await self._client.bounded(pipe.execute())


@dataclass(slots=True)
class Charge:
    """One request's tokens, counted up front (prompt plus requested output, as OpenAI does); `settle` corrects the
    budgets to what it used."""

    quota: Quota
    policy: KeyPolicy
    estimate: int
    periods: list[Period] = field(default_factory=list)
    budgets_shared: bool = False  # the budgets reserved in Redis (else in process)
    tokens_shared: bool = False  # the tokens per minute taken in Redis
    reconcile: bool = False  # tokens per minute too: the estimate was a guess (remote models)
    held: bool = False  # a stream settles when it ends, not when the handler returns
    headers: dict[str, str] = field(default_factory=dict)  # the tokens per minute's x-ratelimit-* headers
    settled: bool = False

    def settle(self, prompt: int, completion: int) -> None:
        """Settled to the tokens the request used (once)."""
        if self.settled:
            return
        self.settled = True
        labels = (self.policy.key_id, self.policy.team)
        prompts = metrics.labelled(metrics.KEY_PROMPT_TOKENS, *labels)
        completions = metrics.labelled(metrics.KEY_COMPLETION_TOKENS, *labels)
        if prompt or completion:  # a cache hit used none: its series exist, nothing to add (inc takes a lock)
            prompts.inc(prompt)
            completions.inc(completion)
        delta = prompt + completion - self.estimate
        if delta:
            self.quota.correct(self, delta)


class Quota:
    def __init__(self, settings: LimitsSettings, pools: RedisPools) -> None:
        self.settings = settings
        self.local = LocalCounts()
        self.shared = RedisCounts(settings, pools) if settings.redis_url else None
        self._down_until = 0.0
        self._tasks: set[asyncio.Task[None]] = set()

    async def take_request(self, policy: KeyPolicy) -> dict[str, str]:
        """The request counted against the key's requests per minute: its x-ratelimit-* headers."""
        if policy.rpm is None:
            return {}
        allowed, tokens, _ = await self._bucket(f"requests:{policy.key_id}", policy.rpm, 1, False)
        return _report("requests", policy.rpm, 1, allowed, tokens)

    async def charge(self, policy: KeyPolicy, tokens: int, reconcile: bool = False) -> Charge:
        if policy.tpm is not None and tokens > policy.tpm:  # waiting cannot help: a 400, no Retry-After
            metrics.labelled(metrics.RATE_LIMITED, "tokens").inc()
            raise OverTokenLimit(
                f"This request asks for {tokens} tokens (the prompt and max_tokens for every choice), more "
                f"than the limit of {policy.tpm} tokens per minute allows: reduce the prompt, max_tokens or n.",
                param="max_tokens",
            )
        charge = Charge(self, policy, tokens, periods(policy), reconcile=reconcile)
        if charge.periods:
            await self._reserve(charge)
        if policy.tpm is not None:
            allowed, left, shared = await self._bucket(f"tokens:{policy.key_id}", policy.tpm, tokens, False)
            try:
                charge.headers = _report("tokens", policy.tpm, tokens, allowed, left)
            except RateLimited:
                if charge.periods:
                    self.correct(replace(charge, reconcile=False), -tokens)  # not served: the reservation goes back
                raise
            charge.tokens_shared = shared
        return charge

    async def _bucket(self, name: str, capacity: int, amount: float, force: bool) -> tuple[bool, float, bool]:
        """(allowed, tokens left, counted in Redis)."""
        if shared := self._shared_up():
            try:
                return (*await shared.bucket(name, capacity, amount, force), True)
            except ERRORS as exc:
                self._failed("bucket", exc)
        return (*self.local.bucket(name, capacity, amount, force), False)

    async def _reserve(self, charge: Charge) -> None:
        result: tuple[int, int] | None = None
        if shared := self._shared_up():
            try:
                result = await shared.reserve(charge.periods, charge.estimate)
                charge.budgets_shared = True
            except ERRORS as exc:
                self._failed("budget", exc)
        if result is None:
            result = self.local.reserve(charge.periods, charge.estimate)
        index, used = result
        if index:
            _refuse_budget(charge.policy, charge.periods[index - 1], charge.estimate, used)

    def correct(self, charge: Charge, delta: int) -> None:
        """Budgets (and, for an estimate, tokens per minute) moved by `delta` tokens, where they were counted: in
        process at once, in Redis off the request's path."""
        tokens = charge.reconcile and charge.policy.tpm is not None
        if not charge.budgets_shared:
            self.local.adjust(charge.periods, delta)
        if tokens and not charge.tokens_shared:
            self.local.bucket(f"tokens:{charge.policy.key_id}", charge.policy.tpm or 0, delta, force=True)
        if (charge.periods and charge.budgets_shared) or (tokens and charge.tokens_shared):
            task = asyncio.get_running_loop().create_task(self._correct_shared(charge, delta))
            self._tasks.add(task)  # off the request's path, awaited by `aclose`
            task.add_done_callback(self._tasks.discard)

    async def _correct_shared(self, charge: Charge, delta: int) -> None:
        assert self.shared is not None
        try:
            if charge.periods and charge.budgets_shared:
                await self.shared.adjust(charge.periods, delta)
            if charge.reconcile and charge.policy.tpm and charge.tokens_shared:
                await self.shared.bucket(f"tokens:{charge.policy.key_id}", charge.policy.tpm, delta, True)
        except ERRORS as exc:
            self._failed("settle", exc)  # Redis counted the estimate; this correction is lost

    def finish(self, policy: KeyPolicy, status: int, charge: Charge | None, usage: tuple[int, int]) -> None:
        """The end of a request (`middleware.auth`): its usage (prompt, completion tokens)
        counted and its charge settled, unless a stream holds it (it settles when the stream ends)."""
        if 200 <= status < 300:
            metrics.labelled(metrics.KEY_REQUESTS, policy.key_id, policy.team).inc()
        if charge is not None and not charge.held:
            charge.settle(*usage)

    def _shared_up(self) -> RedisCounts | None:
        """Redis's counts, unless there is none or it failed less than `redis_retry_s` ago."""
        if self.shared is None:
            return None
        if time.monotonic() < self._down_until:
            metrics.LIMITS_LOCAL.inc()
            return None
        if self._down_until:
            self._down_until = 0.0
            log.info("limits_redis_restored")
        return self.shared

    def _failed(self, operation: str, exc: BaseException) -> None:
        metrics.labelled(metrics.LIMITS_REDIS_ERRORS, operation).inc()
        metrics.LIMITS_LOCAL.inc()
        if not self._down_until:
            log.warning("limits_redis_unavailable", operation=operation, error=str(exc) or type(exc).__name__,
                        counting="in process", retry_s=self.settings.redis_retry_s)
        self._down_until = time.monotonic() + self.settings.redis_retry_s

    async def aclose(self) -> None:
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)


def _report(kind: str, limit: int, amount: float, allowed: bool, tokens: float) -> dict[str, str]:
    """OpenAI's x-ratelimit-* headers; a refusal (with them and Retry-After) raised."""
    headers: dict[str, str] = {}
    headers[f"x-ratelimit-limit-{kind}"] = str(limit)
    headers[f"x-ratelimit-remaining-{kind}"] = str(max(0, int(tokens)))
    headers[f"x-ratelimit-reset-{kind}"] = duration(max(0.0, (limit - tokens) * 60.0 / limit))
    if allowed:
        return headers
    metrics.labelled(metrics.RATE_LIMITED, kind).inc()
    wait = max(0.0, (amount - tokens) * 60.0 / limit) if amount <= limit else 60.0
    headers["retry-after"] = str(max(1, round(wait)))
    raise RateLimited(
        f"Rate limit reached for {kind} per minute: limit {limit}, asked {int(amount)}. "
        f"Please try again in {duration(wait)}.", headers=headers,
    )


def _refuse_budget(policy: KeyPolicy, period: Period, amount: int, used: int) -> None:
    metrics.labelled(metrics.QUOTA_REFUSED, policy.key_id, period.name).inc()
    if amount > period.limit:  # no fresh period can take it: no Retry-After, or clients retry for ever
        raise QuotaExceeded(
            f"You exceeded your current quota: this request counts {amount} tokens (its prompt and "
            f"max_tokens), more than this key's whole budget of {period.limit} tokens per {period.name}. "
            "Lower max_tokens or the prompt.",
        )
    wait = max(1, int((period.renews - datetime.now(UTC)).total_seconds()) + 1)
    raise QuotaExceeded(
        f"You exceeded your current quota: this key has used {used} of its {period.limit} tokens for this "
        f"{period.name}, which renews at {period.renews:%Y-%m-%dT%H:%M:%SZ}.",
        headers={"Retry-After": str(wait)},
    )
