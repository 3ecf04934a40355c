"""The race: this gateway against vLLM's own OpenAI server and against the engine alone.

    python -m benchmarks.race [--repeats 3] [--concurrency 1 4 16 64] [--eager] [--write-results-md]

Same machine, same model (the prepared default model directory), same engine settings (float32,
max_model_len 2048, a 2 GiB KV cache, torch.compile unless --eager):

  gateway  `python -m gateway serve ...` (response cache off, no warm-up, its own log level warning)
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
import importlib.util
import json
import os
import shlex
import signal
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from benchmarks import loadgen
from benchmarks.loadgen import LoadConfig, Result, Session
from benchmarks.procs import GIB, REPO, STARTED, Proc, busy_processes, free_port, log, machine, meminfo, versions
from benchmarks.race_report import (
    SERVED_NAME,
    TARGETS,
    kept_part,
    markdown,
    metrics_of,
    num,
    plot,
    results_md,
    summarize,
)

BENCH = REPO / "benchmarks"
PARTS = ("gateway", "vllm", "engine", "cache", "echo")
ENGINE_OVERHEAD_BYTES = int(1.5 * GIB)  # per engine beyond its memory fraction (python, torch, the front end)


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


# Our access line per request off (vLLM's server logs no requests either); vLLM's own logging as
# in vLLM's server (INFO, text), not following our level.
GATEWAY_ENV = {
    "GATEWAY_WARMUP": "false", "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_LOG_LEVEL": "warning",
    "GATEWAY_ENGINE__LOG_LEVEL": "info", "GATEWAY_ENGINE__LOG_FORMAT": "text",
}


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
    log(f"{target.name:7s} r{repeat} c={level:<3d} {metrics['output_tok_s']:.1f} tok/s, TTFT p50 {num(metrics['ttft_p50_ms'])} "
        f"p99 {num(metrics['ttft_p99_ms'])} ms, TPOT p50 {num(metrics['tpot_p50_ms'])} ms, failed {metrics['failed']}"
        + "".join(f", {name} CPU {num(s)} s" for name, s in cpu.items()))
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
    log(f"{scenario} c={result.concurrency}: {metrics['req_s']:.1f} req/s, e2e p50 {num(metrics['e2e_p50_ms'], 2)} ms {note}")
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
        for proc in reversed(STARTED):
            proc.stop()
    finish(document, args)
    if document["runs"] or document.get("overhead"):
        write_outputs(document, args)
    return code


if __name__ == "__main__":
    sys.exit(main())
