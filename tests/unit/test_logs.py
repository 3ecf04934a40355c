"""The real log configuration (gateway.telemetry.logs) on forced server errors, in a child process so that the
global logging set-up is the production one: tracebacks come without locals in both formats (in
JSON as structured frames), and neither the API key nor the prompt reaches any line unless
`log_prompts` is on."""

from __future__ import annotations

import datetime as real_datetime
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).parents[2]
KEY = "sk-LEAKED-KEY-4711"
PROMPT = "my-private-PROMPT-0815"

SCRIPT = textwrap.dedent(
    f"""
    import sys
    from starlette.testclient import TestClient
    from engine.errors import EngineError
    from gateway.telemetry.logs import configure
    from tests.fakes import FakeEngine, app_with

    class Failing(FakeEngine):
        async def generate(self, request):
            if self.how == "engine":
                raise EngineError("the engine failed: something inside")
            async for output in super().generate(request):
                yield output

    configure("info", sys.argv[1])
    engine = Failing()
    settings = dict(api_keys=["{KEY}"], log_prompts=sys.argv[2] == "prompts")
    body = {{"model": "fake-model", "messages": [{{"role": "user", "content": "{PROMPT}"}}], "max_tokens": 4}}
    headers = {{"Authorization": "Bearer {KEY}"}}
    with TestClient(app_with(engine, **settings), raise_server_exceptions=False) as client:
        statuses = []
        for how, fail_after, stream in (("bug", 0, False), ("engine", None, False), ("bug", 2, True), ("ok", None, False)):
            engine.how, engine.fail_after = how, fail_after
            statuses.append(client.post("/v1/chat/completions", json={{**body, "stream": stream}}, headers=headers).status_code)
    print(statuses)
    """
)


def run(fmt: str, prompts: bool = False) -> tuple[str, str]:
    result = subprocess.run(
        [sys.executable, "-c", SCRIPT, fmt, "prompts" if prompts else "quiet"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result.stdout.strip(), result.stderr


@pytest.mark.parametrize("fmt", ["console", "json"])
def test_server_errors_log_a_traceback_without_key_prompt_or_locals(fmt: str) -> None:
    statuses, log = run(fmt)
    assert statuses == "[500, 500, 200, 200]"  # the third fails mid-stream
    assert KEY not in log
    assert PROMPT not in log
    assert "fake engine failure" in log
    assert "the engine failed: something inside" in log
    assert len(log) < 100_000  # a traceback, not every frame's variables (~270 KB per error before)
    if fmt == "console":
        assert log.count("Traceback (most recent call last)") == 2
        assert "'type': 'http'" not in log  # no frame's scope (a local) printed
        return
    lines = [json.loads(line) for line in log.splitlines() if line.startswith("{")]
    assert len(lines) == len(log.splitlines())  # every line is one JSON object
    failed = [line for line in lines if line["event"] == "request_failed"]
    assert len(failed) == 2
    for line in failed:
        trace = line["exception"][0]
        assert trace["exc_type"] in ("RuntimeError", "EngineError")
        assert trace["frames"]
        assert all("locals" not in frame for frame in trace["frames"])
        assert line["request_id"]


def test_with_log_prompts_the_prompt_is_logged_but_still_not_the_key() -> None:
    """The control: the log does see prompts when asked to, so their absence above means something."""
    _, log = run("json", prompts=True)
    assert PROMPT in log
    assert KEY not in log


class _Clock:
    """A stand-in for the `datetime` module, its `now` fixed (what both renderings stamp)."""

    def __init__(self, now: Any) -> None:
        self.timezone = real_datetime.timezone
        self.UTC = real_datetime.UTC
        self.datetime = self
        self._now = now

    def now(self, tz: Any = None) -> Any:
        return self._now


@pytest.mark.parametrize("level", ["info", "warning"])
@pytest.mark.parametrize("microsecond", [0, 123])
def test_the_json_access_line_is_the_line_structlog_renders(
    monkeypatch: pytest.MonkeyPatch, level: str, microsecond: int
) -> None:
    """`_JsonAccessLine` (the access line's JSON, without structlog's chain) against the chain."""
    import io
    import logging

    import structlog

    from gateway.telemetry import logs

    clock = _Clock(real_datetime.datetime(2026, 1, 2, 3, 4, 5, microsecond, tzinfo=real_datetime.UTC))
    monkeypatch.setattr(structlog.processors, "datetime", clock)
    monkeypatch.setattr(logs, "datetime", clock)
    streams = io.StringIO(), io.StringIO()
    number = logging.getLevelName(level.upper())
    chain = structlog.wrap_logger(
        logs._HandlerLines(logging.StreamHandler(streams[0])),
        processors=[*logs.shared_processors(), *logs.renderer("json", colors=False)],
        wrapper_class=structlog.make_filtering_bound_logger(number),
    )
    fast = logs._JsonAccessLine(logs._HandlerLines(logging.StreamHandler(streams[1])), number)
    lines = [
        dict(method="POST", path="/v1/chat/completions", status=200, duration_s=0.0123, first_byte_s=None,
             model="m", prompt_tokens=3, guards=["input:pii:redact"], prompt="é \"quoted\"\n"),
        dict(method="GET", path="/x", status=500, duration_s=1.0, first_byte_s=0.5, model="bound too"),
        dict(method="GET", path="/y", status=200, duration_s=0.0, first_byte_s=0.0, prompt_tokens=2**70),  # stdlib json
    ]
    with structlog.contextvars.bound_contextvars(request_id="req-1", model="not over the field", extra=1):
        for fields in lines:
            chain.info("request", **fields)
            fast.info("request", **fields)
    assert streams[1].getvalue() == streams[0].getvalue()
    assert streams[1].getvalue().count("\n") == (3 if level == "info" else 0)
