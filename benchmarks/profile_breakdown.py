"""Where a gateway process's time goes, from a py-spy profile (issue 27 item 1): each busy sample
to the part of the request path that owns its leaf-most frame (a library's, or one of ours), idle
worker threads left out. C code has no frame of its own (py-spy without --native): uvloop's poll,
syscalls and callback dispatch land on the loop's frame, a `transport.write` on the line calling
it, orjson on the line calling it (counted as JSON).

    py-spy record -p PID -d 20 -r 200 -f raw -o prof.txt     # while load runs
    python -m benchmarks.profile_breakdown prof.txt
"""

from __future__ import annotations

import argparse
import linecache
import re
import sys
from collections import Counter
from pathlib import Path

FRAME = re.compile(r"(?P<func>.*) \((?P<path>.*):(?P<line>\d+)\)$")
LIBRARIES = (  # path prefix → part, the first that matches
    (("concurrent/futures/thread.py", "threading.py"), "idle thread"),
    (("structlog/", "logging/", "gateway/telemetry/logs.py"), "logging"),
    (("prometheus_client/", "gateway/telemetry/metrics.py"), "metrics"),
    (("opentelemetry", "gateway/telemetry/tracing.py", "gateway/telemetry/record.py"), "tracing, request record"),
    (("aiohttp/", "yarl/", "multidict/", "propcache/", "gateway/backends/upstream.py"), "upstream client (aiohttp)"),
    (("uvicorn/", "httptools/", "gateway/server/http.py"), "HTTP server (uvicorn, httptools)"),
    (("starlette/",), "ASGI framework (Starlette routing, its two middlewares)"),
    (("gateway/apis/", "gateway/web/"), "API layer (read body, encode answer)"),
    (("gateway/pipeline/", "gateway/serving/", "gateway/guards/", "gateway/backends/", "gateway/tenancy/",
      "gateway/stores/"), "pipeline"),
)
SOCKET_WRITE = "transport.write("
LOOP = "event loop (uvloop: poll, socket reads, callbacks)"


def part(func: str, path: str, source: str) -> str | None:
    """The part of the request path a frame belongs to (None: look further up the stack)."""
    if SOCKET_WRITE in source:
        return f"socket writes {'to the upstream' if path.startswith('aiohttp/') else 'to the client'} (send syscalls)"
    if "orjson." in source:
        return "JSON (orjson)"
    if path.startswith(("pydantic/", "pydantic_core/")):
        return f"pydantic: {func.rsplit('.', 1)[-1]}"
    if path.startswith("gateway/middleware/"):
        return f"middleware: {Path(path).stem}"
    for prefixes, name in LIBRARIES:
        if path.startswith(prefixes):
            return name
    if func == "Runner.run":
        return LOOP
    if path.startswith("asyncio/"):
        return "asyncio (tasks, futures, contextvars)"
    return None


def breakdown(lines: list[str], roots: list[Path]) -> tuple[Counter[str], int]:
    """Samples per part, and the busy samples in all."""
    def source(path: str, line: int) -> str:
        for root in roots:
            if (full := root / path).exists():
                return linecache.getline(str(full), line)
        return ""

    parts: Counter[str] = Counter()
    for raw in lines:
        stack, _, count = raw.rstrip("\n").rpartition(" ")
        name = None
        for frame in reversed(stack.split(";")):
            if (m := FRAME.match(frame)) and (name := part(m["func"], m["path"], source(m["path"], int(m["line"])))):
                break
        parts[name or "other"] += int(count)
    parts.pop("idle thread", None)
    return parts, sum(parts.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="A py-spy raw profile of the gateway, by part of the request path")
    p.add_argument("profiles", nargs="+", type=Path, help="py-spy record -f raw outputs")
    p.add_argument("--root", type=Path, action="append", default=[],
                   help="where the profiled sources are (to read a frame's line); default: ., site-packages, stdlib")
    args = p.parse_args(argv)
    import asyncio
    import sysconfig
    roots = args.root or [Path("."), Path(sysconfig.get_paths()["purelib"]), Path(asyncio.__file__).parents[1]]
    results = [breakdown(path.read_text().splitlines(), roots) for path in args.profiles]
    names = sorted({n for parts, _ in results for n in parts}, key=lambda n: -sum(r[0][n] / r[1] for r in results))
    print("| part | " + " | ".join(path.stem for path in args.profiles) + " |")
    print("|---|" + "---:|" * len(results))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{100 * parts[name] / total:.1f}%" for parts, total in results) + " |")
    print("| busy samples | " + " | ".join(str(total) for _, total in results) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
