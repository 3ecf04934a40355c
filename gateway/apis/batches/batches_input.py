"""A batch file's check (purpose `batch`), read from disk line by line, never whole: each line one JSON object
`{"custom_id", "method": "POST", "url", "body"}`, as OpenAI's batch input is. The first bad line is a 400 that names its
number (1-based), so a client can find and fix it. A batch checks its input again before it runs (`check_batch_input`:
each line a request to the batch's endpoint, each custom_id once), then reads it one request at a time (`read_lines`).
Run in a worker thread (`asyncio.to_thread`): parsing 200 MB of JSON is seconds of CPU."""

from __future__ import annotations

import functools
from collections.abc import Generator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from gateway.protocol.batch_objects import BatchError

URLS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")  # of an uploaded file
MESSAGES = "/v1/messages"  # the lines of Anthropic's Message Batches (never of an uploaded file)
_UNBOUNDED = 1 << 62


def check_batch_input(path: Path, endpoint: str | None, max_errors: int = 100, max_lines: int = _UNBOUNDED,
                      max_line_bytes: int = _UNBOUNDED) -> tuple[int, list[BatchError]]:
    """A batch file's check, the upload's (`endpoint` None: each line a request to one of `URLS`) or a batch's before it
    runs (each line a request to its `endpoint`), each custom_id once. (The number of lines read, the first
    `max_errors` problems found.)"""
    seen: set[str] = set()
    problems: list[BatchError] = []
    number = 0
    with path.open("rb") as lines:
        while len(problems) < max_errors and (line := lines.readline(max_line_bytes + 1)):
            number += 1
            if len(line.rstrip(b"\r\n")) > max_line_bytes:
                problems.append(_bad(number, f"is longer than {max_line_bytes} bytes"))
            elif number > max_lines:
                problems.append(BatchError(message=f"The batch file has more than {max_lines} requests (lines)"))
            elif (problem := _check_line(line, number, seen, (*URLS, MESSAGES) if endpoint else URLS)) is not None:
                problems.append(problem)
            elif endpoint is not None and (url := orjson.loads(line)["url"]) != endpoint:
                problems.append(_bad(number, f"asks for {url}, but the batch's endpoint is {endpoint}",
                                     "mismatched_endpoint", "url"))
    if number == 0:
        problems.append(BatchError(code="empty_file", message="The batch file is empty: it needs one request per line"))
    return number, problems


def _check_line(line: bytes, number: int, seen: set[str], urls: tuple[str, ...]) -> BatchError | None:
    """The line's problem, if it has one."""
    bad = functools.partial(_bad, number)
    if not line.strip():
        return bad("is empty: each line must be one request")
    try:
        request: Any = orjson.loads(line)
    except orjson.JSONDecodeError:
        return bad("is not valid JSON")
    if not isinstance(request, dict):
        return bad("is not a JSON object")
    custom_id = request.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return bad("has no 'custom_id' (a non-empty string)")
    if custom_id in seen:
        return bad(f"repeats the custom_id '{custom_id[:64]}': each must be unique within the file",
                   "duplicate_custom_id", "custom_id")
    seen.add(custom_id)
    if request.get("method") != "POST":
        return bad("must have 'method': 'POST'")
    if request.get("url") not in urls:
        return bad(f"has an unsupported 'url': it must be one of {', '.join(urls)}")
    if not isinstance(request.get("body"), dict):
        return bad("has no 'body' object (the request's JSON body)")
    extra = sorted(set(request) - {"custom_id", "method", "url", "body"})
    if extra:
        return bad(f"has an unrecognized field '{extra[0][:64]}'")
    return None


def _bad(number: int, problem: str, code: str = "invalid_request", param: str | None = None) -> BatchError:
    return BatchError(code=code, line=number, message=f"Line {number} of the batch file {problem}.", param=param)


@dataclass(slots=True, frozen=True)
class BatchLine:
    """One request of a batch: its custom_id, url and body (JSON, as a request to its route carries)."""

    custom_id: str
    url: str
    body: bytes


def read_lines(path: Path) -> Generator[BatchLine, None, None]:
    """The requests of a batch file already checked (`check_batch_input`), in order."""
    with path.open("rb") as lines:
        for line in lines:
            request = orjson.loads(line)
            yield BatchLine(request["custom_id"], request["url"], orjson.dumps(request["body"]))
