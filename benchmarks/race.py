"""The race (benchmarks/README.md, "The race"): the gateway against vLLM's own server and the engine
alone, each ratio beside its A/A twin, with our client or `vllm bench serve` (`--client vllm`); then
the gateway on the echo engine against the bare app (`--parts echo`). Tables: race_report.py."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

from benchmarks import loadgen, procs, vllm_bench
from benchmarks.loadgen import LoadConfig, Session, metrics_of
from benchmarks.procs import GIB, REPO, Proc, log, num, rotated
from benchmarks.race_report import SERVED_NAME, TARGETS, finish, kept_part, markdown, results_md

BENCH = REPO / "benchmarks"
PARTS = ("gateway", "vllm", "engine", "echo")
AA = "gateway-aa"
ENGINE_OVERHEAD_BYTES = int(1.5 * GIB)  # per engine beyond its KV cache (python, torch, the front end)
BENCH_KEY = "sk-race-bench"  # the echo gateway's API key: auth is on there, as in production
RUN_TIMEOUT_S = START_TIMEOUT_S = 900.0  # the time limit of one run, and of a server's start
MIN_REQUESTS = 16  # per model-part run, at least
ECHO_PAUSE_S = 0.5  # quiet before each echo-part run
SCENARIOS = {"non-stream": (False, False), "stream": (True, False), "cache hit": (False, True),
             "cache hit, stream": (True, True)}  # echo part: name -> (streamed, cache hit)
# No access line per request (vLLM's server logs none either); vLLM's own logging as in its server.
GATEWAY_ENV = {"GATEWAY_WARMUP": "false", "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_LOG_LEVEL": "warning",
               "GATEWAY_ENGINE__LOG_LEVEL": "info", "GATEWAY_ENGINE__LOG_FORMAT": "text"}
# The echo gateway as deployed: access lines (info, JSON), metrics, an API key, request ids, the memory cache.
ECHO_ENV = {"GATEWAY_WARMUP": "false", "GATEWAY_LOG_LEVEL": "info", "GATEWAY_LOG_FORMAT": "json",
            "GATEWAY_API_KEYS": json.dumps([BENCH_KEY]), "GATEWAY_CACHE__BACKEND": "memory"}


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="Race the gateway against vLLM's server and the engine alone",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    add = p.add_argument
    add("--concurrency", type=int, nargs="+", default=[1, 4, 16, 64])
    add("--repeats", type=int, default=3, help="repetitions; numbers are medians over them")
    add("--eager", action="store_true", help="engines in eager mode (--enforce-eager): quick start, slower decoding")
    add("--input-tokens", type=int, default=128)
    add("--output-tokens", type=int, default=64)
    add("--endpoint", choices=["completions", "chat"], default="completions",
        help="completions: prompts of exactly --input-tokens tokens; chat adds the template's tokens")
    add("--waves", type=int, default=4, help=f"at least WAVES x concurrency (and {MIN_REQUESTS}) requests per run")
    add("--parts", nargs="+", choices=PARTS, default=list(PARTS), help="what to run")
    add("--client", choices=["ours", "vllm"], default="ours",
        help="the servers' client: benchmarks.loadgen, or vLLM's `vllm bench serve` (benchmarks.vllm_bench)")
    add("--no-aa", dest="aa", action="store_false", help="no A/A twin (gateway-aa, echo-aa)")
    add("--ceiling-duration", type=float, default=2.0,
        help="after every server run: seconds of the same load against the instant endpoint (0: none)")
    add("--model", help="model directory (default: the prepared default model)")
    add("--dtype", default="float32")
    add("--max-model-len", type=int, default=2048)
    add("--kv-cache-memory-bytes", type=int, default=2 * GIB,
        help="KV cache of every engine; a fixed size, unlike a memory fraction, lets three engines start on one node")
    add("--pause", type=float, default=2.0, help="seconds of quiet before each run")
    add("--echo-concurrency", type=int, nargs="+", default=[1, 16, 64])
    add("--echo-requests", type=int, default=2000, help="requests per echo-part run")
    add("--echo-scenarios", nargs="+", choices=list(SCENARIOS), default=["non-stream", "stream", "cache hit"])
    add("--results-dir", type=Path, default=BENCH / "results")
    add("--write-results-md", action="store_true", help="rewrite benchmarks/RESULTS.md with this race")
    return p


# ----------------------------------------------------------------------------------------------
# The targets: the same model and engine settings for every engine


def python_m(module: str, *args: str) -> list[str]:
    return [sys.executable, "-m", module, *args]


def prepare_model() -> str:
    subprocess.run(python_m("engine.models", "prepare"), cwd=REPO, check=True, stdout=sys.stderr)
    out = subprocess.run(python_m("engine.models", "path"), cwd=REPO, check=True, capture_output=True, text=True)
    return out.stdout.strip().splitlines()[-1]


def _engine_flags(args: argparse.Namespace, eager: bool) -> list[str]:
    return ["--host", "127.0.0.1", "--model", args.model, "--served-model-name", SERVED_NAME,
            "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
            "--kv-cache-memory-bytes", str(args.kv_cache_memory_bytes)] + (["--enforce-eager"] if eager else [])


def gateway_command(args: argparse.Namespace, eager: bool) -> list[str]:
    return python_m("gateway", "serve", *_engine_flags(args, eager))


def vllm_command(args: argparse.Namespace, eager: bool) -> list[str]:
    """vLLM 0.32's server (pinned in pyproject.toml) with request logs and uvicorn's access log off."""
    return python_m("vllm.entrypoints.openai.api_server", *_engine_flags(args, eager), "--seed", "0",
                    "--no-enable-log-requests", "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning")


class EngineAlone(Proc):
    """The engine alone (benchmarks.engine_direct): one run per command, with the servers' very prompts."""

    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        engine = {"model": args.model, "served_model_name": SERVED_NAME, "dtype": args.dtype, "seed": 0,
                  "max_model_len": args.max_model_len, "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
                  "enforce_eager": args.eager}
        settings = {"engine": engine, "load": load_config(args, "http://engine.invalid/v1", 1, 1).to_dict()}
        super().__init__("engine", python_m("benchmarks.engine_direct", "--settings", json.dumps(settings)), {},
                         logs / "engine.log", commanded=True)

    async def wait_ready(self, timeout_s: float) -> float:
        took = float((await self.answer(timeout_s))["ready"])
        log(f"engine ready in {took:.0f} s")
        return took

    async def load(self, sessions: list[Session], concurrency: int, label: str, timeout_s: float) -> dict[str, Any]:
        self.send({"concurrency": concurrency, "label": label, "sessions": [dataclasses.asdict(s) for s in sessions]})
        return dict((await self.answer(timeout_s))["result"])


class Again:
    """The A/A slot: the same server measured once more in every round, under another name."""

    def __init__(self, target: Proc, name: str) -> None:
        self.target, self.name = target, name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self.target, attr)


Target = Any  # a Proc (a server, loaded over HTTP), its A/A twin (Again) or EngineAlone


# ----------------------------------------------------------------------------------------------
# The model part


@dataclasses.dataclass
class Plan:
    sessions: dict[tuple[int, int], list[Session]]  # (repeat, level) -> sessions, the same for every target
    warmup: list[tuple[int, list[Session]]]  # (concurrency, sessions)


def load_config(args: argparse.Namespace, base_url: str, level: int, n: int, label: str = "") -> LoadConfig:
    return LoadConfig(base_url=base_url, model=SERVED_NAME, endpoint=args.endpoint, concurrency=level, num_requests=n,
                      duration_s=RUN_TIMEOUT_S, input_tokens=args.input_tokens, output_tokens=args.output_tokens,
                      ignore_eos=True, temperature=0.0, stream=True, label=label, request_timeout_s=RUN_TIMEOUT_S)


def run_seed(repeat: int, index: int) -> int:
    """The prompts' seed of one repetition and level: the same for every target."""
    return 100_000 * (repeat + 1) + 1000 * index


async def make_plan(args: argparse.Namespace, base_url: str | None) -> Plan:
    """Prompts for every (repetition, level), fitted with the server's tokenizer when one is up."""
    probe = load_config(args, base_url or "http://127.0.0.1:9/v1", 1, 1)
    async with loadgen.make_client(probe) as client:
        tokenizer = await loadgen.ServerTokenizer.probe(client, base_url, SERVED_NAME) if base_url else None
        if tokenizer is None:
            log("no server tokenizer: prompts are sized at one word per token")

        async def build(n: int, seed: int) -> list[Session]:
            return await loadgen.build_sessions(probe, n, tokenizer, seed=seed)

        sessions = {(r, level): await build(max(MIN_REQUESTS, args.waves * level), run_seed(r, i))
                    for r in range(args.repeats) for i, level in enumerate(args.concurrency)}
        top = max(args.concurrency)
        return Plan(sessions, [(top, await build(top, 1)), (1, await build(2, 2))])


async def load(target: Target, args: argparse.Namespace, level: int, sessions: list[Session], label: str,
               ceiling_s: float = 0.0) -> dict[str, Any]:
    """One run of our client's load (or the engine alone's), as a Result.to_dict()."""
    if isinstance(target, EngineAlone):
        return await target.load(sessions, level, label, RUN_TIMEOUT_S + 60)
    cfg = dataclasses.replace(load_config(args, target.base_url, level, len(sessions), label), ceiling_s=ceiling_s)
    return (await loadgen.run_load(cfg, sessions=sessions)).to_dict()


async def warm_up(target: Target, plan: Plan, args: argparse.Namespace) -> None:
    """Untimed: first requests pay one-time costs (compiled kernels per batch shape, allocations)."""
    for level, sessions in plan.warmup:
        if (result := await load(target, args, level, sessions, "warmup"))["failed"]:
            raise RuntimeError(f"{target.name} failed its warm-up: {result['errors']}")
    log(f"{target.name} warmed up")


def choose_layout(args: argparse.Namespace, notes: list[str], engines: int) -> str:
    """Interleaved when memory allows an engine per target, else one target at a time (sequential)."""
    need = engines * (args.kv_cache_memory_bytes + ENGINE_OVERHEAD_BYTES)
    if (available := procs.meminfo().get("MemAvailable", 0)) >= need:
        return "interleaved"
    notes.append(f"only {available / GIB:.1f} GiB memory available, {engines} engines need about {need / GIB:.1f} GiB: "
                 "targets ran one after the other (sequential layout), not interleaved")
    log(notes[-1])
    return "sequential"


async def vllm_client_run(target: Target, args: argparse.Namespace, repeat: int, level: int,
                          n: int) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run of `vllm bench serve`, then the same run against the instant endpoint (its ceiling)."""
    common = dict(model=SERVED_NAME, tokenizer=args.model, endpoint=args.endpoint, concurrency=level, num_prompts=n,
                  input_len=args.input_tokens, output_len=args.output_tokens,
                  seed=run_seed(repeat, args.concurrency.index(level)))
    data = await vllm_bench.run(vllm_bench.bench_argv(base_url=target.base_url, **common))
    metrics = vllm_bench.metrics_of(data)
    if args.ceiling_duration > 0:
        endpoint = await loadgen.shared_endpoint()
        top = vllm_bench.metrics_of(await vllm_bench.run(vllm_bench.bench_argv(base_url=endpoint.base_url, **common)))
        if metrics["req_s"] and top["req_s"]:
            metrics["client_headroom"] = top["req_s"] / metrics["req_s"]
    return data, metrics


async def measure(target: Target, plan: Plan, args: argparse.Namespace, repeat: int, level: int,
                  others: list[Target]) -> dict[str, Any]:
    await asyncio.sleep(args.pause)
    sessions = plan.sessions[(repeat, level)]
    cpu_before = {p.name: p.cpu_seconds() for p in [target, *others]}
    front_before = target.cpu_seconds(front_only=True)
    if args.client == "vllm" and not isinstance(target, EngineAlone):
        data, metrics = await vllm_client_run(target, args, repeat, level, len(sessions))
    else:
        data = await load(target, args, level, sessions, f"{target.name} r{repeat} c{level}", args.ceiling_duration)
        metrics = metrics_of(data)
    front_after = target.cpu_seconds(front_only=True)
    cpu = {p.name: None if cpu_before[p.name] is None or (now := p.cpu_seconds()) is None else now - cpu_before[p.name]
           for p in [target, *others]}
    if front_before is not None and front_after is not None and (tokens := data.get("total_output_tokens")):
        # the front end's CPU per output token: HTTP, JSON, detokenizing (the engine alone: no HTTP)
        metrics["front_cpu_ms_per_token"] = (front_after - front_before) * 1000 / tokens
    log(f"{target.name:10s} r{repeat} c={level:<3d} {num(metrics['output_tok_s'])} tok/s, TTFT p50 {num(metrics['ttft_p50_ms'])} "
        f"p99 {num(metrics['ttft_p99_ms'])} ms, TPOT p50 {num(metrics['tpot_p50_ms'])} ms, failed {metrics['failed']}, "
        f"client headroom {num(metrics.get('client_headroom'))}x")
    return {"target": target.name, "repeat": repeat, "concurrency": level, "metrics": metrics, "cpu_s": cpu, "result": data}


def model_targets(args: argparse.Namespace, wanted: list[str], logs: Path) -> dict[str, Target]:
    targets: dict[str, Target] = {}
    if "gateway" in wanted:
        targets["gateway"] = Proc.on_free_port("gateway", gateway_command(args, args.eager), GATEWAY_ENV, logs)
        if args.aa:
            targets[AA] = Again(targets["gateway"], AA)
    if "vllm" in wanted:
        targets["vllm"] = Proc.on_free_port("vllm", vllm_command(args, args.eager), {}, logs)
    if "engine" in wanted:
        targets["engine"] = EngineAlone(args, logs)
    return targets


async def run_models(args: argparse.Namespace, logs: Path, document: dict[str, Any]) -> None:
    if not (wanted := [t for t in TARGETS if t in args.parts]):
        return
    notes: list[str] = document["notes"]
    layout = document["layout"] = choose_layout(args, notes, len(wanted)) if len(wanted) > 1 else "single"
    targets = model_targets(args, wanted, logs)
    groups = [list(targets)] if layout == "interleaved" else [[n for n in targets if n in (t, AA if t == "gateway" else t)] for t in wanted]
    plan: Plan | None = None
    for group in groups:
        alive = [targets[t] for t in group]
        started = [t for t in alive if not isinstance(t, Again)]
        for t in started:
            t.start()
        startup = await asyncio.gather(*(t.wait_ready(START_TIMEOUT_S) for t in started))
        document.setdefault("startup_s", {}).update({t.name: round(s, 1) for t, s in zip(started, startup, strict=True)})
        if plan is None:
            servers = [t for t in started if not isinstance(t, EngineAlone)]
            plan = await make_plan(args, servers[0].base_url if servers else None)
        for t in started:
            await warm_up(t, plan, args)
        if busy := procs.busy_processes(exclude=[t.process.pid for t in started if t.process]):
            notes.append("other processes were busy when the measurements started: " + "; ".join(busy[:5]))
            log(notes[-1])
        for r in range(args.repeats):
            for i, level in enumerate(args.concurrency):
                for t in rotated(alive, r + i):
                    others = [o for o in started if o is not t]
                    document["runs"].append(await measure(t, plan, args, r, level, others))
        for t in started:
            t.stop()


# ----------------------------------------------------------------------------------------------
# The echo part: the gateway on the echo engine as deployed against the bare app


def scenario_config(args: argparse.Namespace, scenario: str, base_url: str, level: int, seed: int, label: str) -> LoadConfig:
    stream, hit = SCENARIOS[scenario]
    return LoadConfig(
        base_url=base_url, model=SERVED_NAME, endpoint="completions", concurrency=level,
        num_requests=args.echo_requests, duration_s=RUN_TIMEOUT_S, input_tokens=args.input_tokens,
        output_tokens=args.output_tokens if stream else 1, ignore_eos=True, temperature=0.0, stream=stream,
        api_key=BENCH_KEY, tokenizer="words", seed=seed, unique_prompts=1 if hit else None,
        warmup_requests=1 if hit else min(2 * level, args.echo_requests), count_headers=["x-cache"],
        request_timeout_s=RUN_TIMEOUT_S, label=label, ceiling_s=args.ceiling_duration,
    )


async def measure_echo(target: Target, args: argparse.Namespace, scenario: str, repeat: int, level: int, seed: int) -> dict[str, Any]:
    await asyncio.sleep(ECHO_PAUSE_S)
    cfg = scenario_config(args, scenario, target.base_url, level, seed, f"{target.name} {scenario} r{repeat} c{level}")
    sessions = await loadgen.build_sessions(cfg, loadgen.sessions_needed(cfg), None, seed=seed)
    warm = await loadgen.build_sessions(cfg, 1, None, seed=seed) if SCENARIOS[scenario][1] else None
    result = await loadgen.run_load(cfg, sessions=sessions, warmup_sessions=warm)
    metrics, hits = metrics_of(data := result.to_dict()), result.header_counts.get("x-cache", {})
    log(f"{target.name:8s} {scenario:17s} r{repeat} c={level:<3d} {num(metrics['req_s'])} req/s, "
        f"{num(metrics['output_tok_s'])} tok/s, e2e p50 {num(metrics['e2e_p50_ms'], 2)} ms, failed {metrics['failed']}, "
        f"client headroom {num(metrics.get('client_headroom'))}x" + (f", X-Cache {hits}" if hits else ""))
    return {"target": target.name, "scenario": scenario, "repeat": repeat, "concurrency": level, "metrics": metrics,
            "x_cache": hits, "result": data}


async def run_echo(args: argparse.Namespace, logs: Path, document: dict[str, Any]) -> None:
    echo, bare = await asyncio.gather(
        Proc.on_free_port("echo", python_m("benchmarks.echo_engine", "--name", SERVED_NAME), ECHO_ENV, logs,
                          api_key=BENCH_KEY).launch(120),
        Proc.on_free_port("bare", python_m("benchmarks.instant_endpoint", "--starlette", "--name", SERVED_NAME), {}, logs).launch(60))
    alive: list[Target] = [echo, Again(echo, "echo-aa"), bare] if args.aa else [echo, bare]
    runs = document.setdefault("echo_runs", [])
    for r in range(args.repeats):
        for s, scenario in enumerate(args.echo_scenarios):
            for i, level in enumerate(args.echo_concurrency):
                for j, target in enumerate(rotated(alive, r + s + i)):
                    seed = 10_000_000 * (r + 1) + 100_000 * s + 1000 * i + 10 * j  # fresh prompts every run
                    runs.append(await measure_echo(target, args, scenario, r, level, seed))
    echo.stop()
    bare.stop()


async def race(args: argparse.Namespace, document: dict[str, Any]) -> None:
    """Fills `document` part by part (so an interrupted race still leaves what it measured)."""
    document.update(complete=False, runs=[], notes=[])
    log(f"machine: {document['machine']}")
    if busy := procs.busy_processes():
        document["notes"].append("busy processes before the race: " + "; ".join(busy[:5]))
        log(document["notes"][-1])
    await run_models(args, Path(document["logs"]), document)
    if "echo" in args.parts:
        await run_echo(args, Path(document["logs"]), document)
    document["complete"] = True


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parser().parse_args(argv)
    if any(c < 1 for c in args.concurrency) or args.repeats < 1:
        raise SystemExit("concurrency levels and --repeats must be positive")
    args.model = args.model or prepare_model()
    code, document, out = procs.run_command("race", argv, args, race, markdown, args.results_dir,
                                            finish=lambda document: finish(document, args))
    out.with_suffix(".md").write_text(markdown(document))
    if args.write_results_md and document["complete"]:
        (BENCH / "RESULTS.md").write_text(results_md(document, out.name) + kept_part(BENCH / "RESULTS.md"))
        log("rewrote benchmarks/RESULTS.md")
    elif args.write_results_md:
        log("the race is incomplete: RESULTS.md left as it was")
    return code


if __name__ == "__main__":
    sys.exit(main())
