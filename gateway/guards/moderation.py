"""The optional moderation call: an OpenAI-compatible `/v1/moderations` upstream, reached with httpx.

A call that fails (connection, timeout, a non-200 answer, a body that is not a moderation result) is logged and counted,
and answers None: the guard then serves (fail open) or refuses (fail closed), as configured."""

from __future__ import annotations

from dataclasses import dataclass

import httpx
import structlog
from pydantic import ValidationError

from gateway.guards.config import ModerationUpstream
from gateway.guards.moderation_wire import ModerationRequest, ModerationResponse

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class Verdict:
    flagged: bool
    categories: tuple[str, ...] = ()


class Moderation:
    def __init__(self, upstream: ModerationUpstream, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.model = upstream.model
        self.fail_closed = upstream.fail == "closed"
        key = upstream.api_key.get_secret_value() if upstream.api_key else None
        self._client = httpx.AsyncClient(
            base_url=upstream.url.rstrip("/"),
            headers={"Authorization": f"Bearer {key}"} if key else {},
            timeout=httpx.Timeout(upstream.timeout_s),
            transport=transport,
        )

    async def check(self, text: str) -> Verdict | None:
        """The upstream's verdict on `text`; None when it could not give one."""
        body = ModerationRequest(input=text, model=self.model).model_dump(exclude_none=True)
        try:
            response = await self._client.post("/moderations", json=body)
            if response.status_code != 200:
                raise ValueError(f"answered {response.status_code}")
            results = ModerationResponse.model_validate_json(response.content).results
        except (httpx.HTTPError, ValueError, ValidationError) as exc:
            log.warning("moderation_failed", error=f"{type(exc).__name__}: {exc}", fail="closed" if self.fail_closed else "open")
            return None
        categories = tuple(sorted({c for result in results for c, hit in result.categories.items() if hit}))
        return Verdict(any(result.flagged for result in results), categories)

    async def aclose(self) -> None:
        await self._client.aclose()
