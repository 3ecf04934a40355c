"""One generation's measurements, the same for an embedded engine and a remote upstream: the model's
in-flight gauge while it runs, time to first token, inter-token latency, time per output token,
and the token counts, as metrics and as `Readings` the pipeline hands down and reads back."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from gateway.telemetry import metrics


@dataclass(slots=True)
class Readings:
    """What one attempt's generations measured, for the pipeline to report (the access line, the
    charge's settlement). The pipeline fills in `started` and `log_content` before handing it down."""

    started: float | None = None  # when the request arrived (perf_counter): time to first token counts from there
    log_content: bool = False  # keep the prompt and the outputs (prompt logging is on)
    ttft_s: float | None = None
    prompt_tokens: int | None = None  # None: nothing was counted (no generation ran)
    completion_tokens: int | None = None
    generated: int = 0  # output tokens so far, counted as they come (fair shares read it while it runs)
    ended: bool = False  # every choice came to its end, not cut short: its pace is the engine's (capacity learns it)
    prompt: str | None = None
    output: list[str] = field(default_factory=list)

    def count(self, prompt: int, completion: int) -> None:
        self.prompt_tokens = (self.prompt_tokens or 0) + prompt
        self.completion_tokens = (self.completion_tokens or 0) + completion


class Meter:
    def __init__(self, model: str, readings: Readings | None = None) -> None:
        self.model = model
        self.readings = readings if readings is not None else Readings()
        self.started = self.readings.started or time.perf_counter()
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
            if self.readings.ttft_s is None:
                self.readings.ttft_s = ttft
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
        self.readings.count(prompt, completion)
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
