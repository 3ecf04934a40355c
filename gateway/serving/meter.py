"""One generation's measurements, the same for an embedded engine and a remote upstream: the model's
in-flight gauge while it runs, time to first token, inter-token latency, time per output token,
and the token counts (metrics and the request's access line)."""

from __future__ import annotations

import time

from gateway.telemetry import metrics
from gateway.telemetry.record import RequestRecord


class Meter:
    def __init__(self, model: str, record: RequestRecord) -> None:
        self.model, self.record = model, record
        self.started = record.arrival or time.perf_counter()
        self.first_at: float | None = None
        self.last_at: float | None = None
        self._itl: metrics.Observations | None = None  # from the second token on (none for a one-token answer)
        self._in_flight = False

    def begin(self) -> None:
        metrics.labelled(metrics.IN_FLIGHT, self.model).inc()
        self._in_flight = True

    def token(self) -> bool:
        """A token (or a chunk of them) arrived now; True for the first."""
        at = time.perf_counter()
        first = self.first_at is None
        if first:
            self.first_at = at
            ttft = at - self.started
            metrics.labelled(metrics.TIME_TO_FIRST_TOKEN, self.model).observe(ttft)
            if self.record.ttft_s is None:
                self.record.ttft_s = ttft
        elif self.last_at is not None:
            if self._itl is None:
                self._itl = metrics.Observations(metrics.labelled(metrics.INTER_TOKEN_LATENCY, self.model))
            self._itl.add(at - self.last_at)
        self.last_at = at
        return first

    def count(self, prompt: int, completion: int, choices: int = 1) -> None:
        """The generation's tokens, once it is over (`choices`: completion tokens spread over them). No time
        per output token when they all arrived at one time (a whole remote answer): there is none to tell."""
        metrics.labelled(metrics.PROMPT_TOKENS, self.model).inc(prompt)
        metrics.labelled(metrics.COMPLETION_TOKENS, self.model).inc(completion)
        self.record.prompt_tokens = (self.record.prompt_tokens or 0) + prompt
        self.record.completion_tokens = (self.record.completion_tokens or 0) + completion
        per_choice = completion / max(1, choices)
        if self.first_at is not None and self.last_at is not None and self.last_at > self.first_at and per_choice > 1:
            tpot = (self.last_at - self.first_at) / (per_choice - 1)
            metrics.labelled(metrics.TIME_PER_OUTPUT_TOKEN, self.model).observe(tpot)

    def end(self) -> None:
        """Out of the in-flight gauge (once), the inter-token latencies added."""
        if self._in_flight:
            metrics.labelled(metrics.IN_FLIGHT, self.model).dec()
            self._in_flight = False
        if self._itl is not None:
            self._itl.flush()
            self._itl = None
