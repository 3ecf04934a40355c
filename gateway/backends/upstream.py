"""Remote models: any OpenAI-compatible server (another replica, vLLM's server) reached with httpx.

Requests are forwarded as validated, with `model` renamed to the upstream's name; streams pass
through chunk by chunk, unbuffered. A failure before the first byte (connection refused, timeout,
5xx, 429) raises `BackendUnavailable`, which the dispatcher answers with the next fallback. What
comes back is an `UpstreamAnswer`; the API layer makes the HTTP response of it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import httpx
import structlog

from engine.config import SamplingDefaults
from engine.errors import EngineUnavailable
from gateway import metrics
from gateway.errors import BackendUnavailable

log = structlog.get_logger(__name__)


@dataclass(frozen=True, slots=True)
class UpstreamAnswer:
    """The upstream's answer: a whole body, or (a 200 stream) chunks to pass through."""

    status: int
    media_type: str
    body: bytes = b""
    chunks: AsyncIterator[bytes] | None = None


class Upstream:
    def __init__(self, name: str, url: str, upstream_model: str, api_key: str | None,
                 timeout_s: float, connect_timeout_s: float, transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.name = name
        self.upstream_model = upstream_model
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._client = httpx.AsyncClient(
            base_url=url.rstrip("/"),
            headers=headers,
            timeout=httpx.Timeout(timeout_s, connect=connect_timeout_s),
            transport=transport,
        )

    async def forward(
        self, path: str, body: dict[str, Any], stream: bool, on_close: Callable[[], None]
    ) -> UpstreamAnswer:
        """Forward; `on_close` runs once the answer has been passed on (or failed)."""
        payload = {**body, "model": self.upstream_model}
        request = self._client.build_request("POST", path, json=payload)
        try:
            response = await self._client.send(request, stream=True)
        except httpx.HTTPError as exc:
            raise self._failed(f"{type(exc).__name__}: {exc}") from exc
        if response.status_code >= 500 or response.status_code == 429:
            await response.aclose()
            raise self._failed(f"answered {response.status_code}")
        media_type = response.headers.get("content-type", "application/json")
        if not stream or response.status_code != 200:
            content = await response.aread()
            await response.aclose()
            on_close()
            return UpstreamAnswer(response.status_code, media_type, body=content)
        return UpstreamAnswer(200, media_type, chunks=_passthrough(response, on_close))

    def _failed(self, why: str) -> BackendUnavailable:
        metrics.UPSTREAM_ERRORS.labels(self.name).inc()
        log.warning("upstream_failed", model=self.name, why=why)
        return BackendUnavailable(f"the upstream of '{self.name}' failed: {why}")

    async def check_health(self) -> None:
        try:
            response = await self._client.get("/models", timeout=5)
        except httpx.HTTPError as exc:
            raise EngineUnavailable(f"upstream unreachable: {exc}") from exc
        if response.status_code != 200:
            raise EngineUnavailable(f"upstream answered {response.status_code}")

    async def aclose(self) -> None:
        await self._client.aclose()


def with_defaults(payload: dict[str, Any], defaults: SamplingDefaults | None, output_budget: bool) -> dict[str, Any]:
    """The request with the model's sampling defaults (the models file's `defaults`) where it is
    silent: an upstream cannot know them. `max_tokens` only where the output budget is open (chat),
    as for embedded models."""
    if defaults is None:
        return payload
    values = defaults.model_dump(exclude_none=True)
    if not output_budget or "max_completion_tokens" in payload:
        values.pop("max_tokens", None)
    silent = {key: value for key, value in values.items() if payload.get(key) is None}
    return {**payload, **silent}


async def _passthrough(response: httpx.Response, on_close: Callable[[], None]) -> AsyncIterator[bytes]:
    try:
        async for chunk in response.aiter_raw():
            yield chunk
    finally:
        on_close()
        await response.aclose()  # a client gone mid-stream closes the upstream request too
