"""The race's model part: the gateway (and its A/A twin, the same process), vLLM's server and the
engine alone taking the load in turns, with our client or `vllm bench serve` (`--client vllm`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
from pathlib import Path
from typing import Any

from benchmarks import loadgen, vllm_bench
from benchmarks.loadgen import LoadConfig, Session, ceiling
from benchmarks.procs import GIB, Controlled, Proc, busy_processes, free_port, log, meminfo
from benchmarks.race_report import SERVED_NAME, TARGETS, metrics_of, num
from benchmarks.race_servers import GATEWAY_ENV, engine_settings, gateway_command, python_m, vllm_command

ENGINE_OVERHEAD_BYTES = int(1.5 * GIB)  # per engine beyond its memory fraction (python, torch, the front end)
AA = "gateway-aa"


@dataclasses.dataclass
class Plan:
    levels: list[int]
    repeats: int
    sessions: dict[tuple[int, int], list[Session]]  # (repeat, level) -> sessions
    warmup: list[tuple[int, list[Session]]]  # (concurrency, sessions)


def requests_for(level: int, args: argparse.Namespace) -> int:
    return max(args.min_requests, args.waves * level)


def run_seed(args: argparse.Namespace, repeat: int, index: int) -> int:
    """The prompts' seed of one repetition and level: the same for every target."""
    return int(args.seed + 100_000 * (repeat + 1) + 1000 * index)


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
                sessions[(r, level)] = await loadgen.build_sessions(probe, n, tokenizer, seed=run_seed(args, r, i))
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
        return str(args.layout)
    need = engines * (args.kv_cache_memory_bytes + ENGINE_OVERHEAD_BYTES)
    available = meminfo().get("MemAvailable", 0)
    if available >= need:
        return "interleaved"
    notes.append(
        f"only {available / GIB:.1f} GiB memory available, {engines} engines need about {need / GIB:.1f} GiB: "
        "targets ran one after the other (sequential layout), not interleaved"
    )
    log(notes[-1])
    return "sequential"


class EngineAlone(Controlled):
    """The engine alone (benchmarks.engine_direct --control): runs the plan's runs on command."""

    def __init__(self, args: argparse.Namespace, logs: Path) -> None:
        plan_path = logs / "engine-plan.json"
        load = load_config(args, "http://engine.invalid/v1", 1, 1, "engine").to_dict()
        plan_path.write_text(json.dumps({"engine": engine_settings(args), "load": load}))
        super().__init__("engine", python_m("benchmarks.engine_direct", "--plan", str(plan_path), "--control"),
                         logs / "engine.log")
        self.logs = logs
        self.index: dict[tuple[int, int], int] = {}

    async def wait_ready(self, timeout_s: float) -> float:
        took = float((await self.answer(timeout_s))["ready"])
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
        self.command({"sessions": str(path)})
        await self.answer(args.run_timeout * 2)
        log("engine warmed up")

    async def run(self, repeat: int, level: int, timeout_s: float) -> dict[str, Any]:
        self.command({"run": self.index[(repeat, level)]})
        return dict((await self.answer(timeout_s))["result"])


class VllmClient(Controlled):
    """vLLM's benchmark client (benchmarks.vllm_bench --control): one `vllm bench serve` run per command."""

    def __init__(self, logs: Path) -> None:
        super().__init__("vllm-bench", python_m("benchmarks.vllm_bench", "--control"), logs / "vllm-bench.log")

    async def run(self, argv: list[str], timeout_s: float) -> dict[str, Any]:
        self.command({"argv": argv})
        return dict((await self.answer(timeout_s))["result"])


class Again:
    """The A/A slot: the same server measured once more in every round, under another name."""

    def __init__(self, target: Proc, name: str = AA) -> None:
        self.target, self.name = target, name

    @property
    def base_url(self) -> str:
        return self.target.base_url

    @property
    def process(self) -> Any:
        return self.target.process

    def cpu_seconds(self, front_only: bool = False) -> float | None:
        return self.target.cpu_seconds(front_only)


Target = Any  # a Proc (a server, loaded over HTTP), its A/A twin (Again) or EngineAlone


async def _run_vllm_client(
    client: VllmClient, target: Target, args: argparse.Namespace, repeat: int, level: int, n: int
) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run with vLLM's client, then the same run against the instant endpoint (its ceiling)."""
    index = args.concurrency.index(level)
    common = dict(model=SERVED_NAME, tokenizer=args.model, endpoint=args.endpoint, concurrency=level, num_prompts=n,
                  input_len=args.input_tokens, output_len=args.output_tokens, seed=run_seed(args, repeat, index))
    data = await client.run(vllm_bench.bench_argv(base_url=target.base_url, **common), args.run_timeout + 120)
    metrics = vllm_bench.metrics_of(data)
    if args.ceiling_duration > 0:
        bare = await ceiling.shared_endpoint()
        top = vllm_bench.metrics_of(await client.run(vllm_bench.bench_argv(base_url=bare.base_url, **common), 600))
        if metrics["req_s"] and top["req_s"]:
            metrics["client_headroom"] = top["req_s"] / metrics["req_s"]
    return data, metrics


async def measure(target: Target, plan: Plan, args: argparse.Namespace, repeat: int, level: int,
                  others: list[Target], client: VllmClient | None) -> dict[str, Any]:
    await asyncio.sleep(args.pause)
    sessions = plan.sessions[(repeat, level)]
    cpu_before = {p.name: p.cpu_seconds() for p in [target, *others]}
    front_before = target.cpu_seconds(front_only=True)
    if isinstance(target, EngineAlone):
        data = await target.run(repeat, level, args.run_timeout + 60)
        metrics = metrics_of(data)
    elif client is not None:
        data, metrics = await _run_vllm_client(client, target, args, repeat, level, len(sessions))
    else:
        cfg = load_config(args, target.base_url, level, len(sessions), f"{target.name} r{repeat} c{level}")
        cfg = dataclasses.replace(cfg, ceiling_s=args.ceiling_duration)
        data = (await loadgen.run_load(cfg, sessions=sessions)).to_dict()
        metrics = metrics_of(data)
    front_after = target.cpu_seconds(front_only=True)
    cpu_after = {p.name: p.cpu_seconds() for p in [target, *others]}
    cpu = {name: (cpu_after[name] - before) if before is not None and cpu_after[name] is not None else None
           for name, before in cpu_before.items()}
    tokens = data.get("total_output_tokens") or 0
    if front_before is not None and front_after is not None and tokens:
        # the front end's CPU per output token: HTTP, JSON, detokenizing (the engine alone: no HTTP)
        metrics["front_cpu_ms_per_token"] = (front_after - front_before) * 1000 / tokens
    log(f"{target.name:10s} r{repeat} c={level:<3d} {num(metrics['output_tok_s'])} tok/s, TTFT p50 {num(metrics['ttft_p50_ms'])} "
        f"p99 {num(metrics['ttft_p99_ms'])} ms, TPOT p50 {num(metrics['tpot_p50_ms'])} ms, failed {metrics['failed']}, "
        f"client headroom {num(metrics.get('client_headroom'))}x")
    return {"target": target.name, "repeat": repeat, "concurrency": level, "metrics": metrics, "cpu_s": cpu, "result": data}


def _targets(args: argparse.Namespace, wanted: list[str], logs: Path) -> dict[str, Target]:
    targets: dict[str, Target] = {}
    if "gateway" in wanted:
        port = args.gateway_port or free_port()
        targets["gateway"] = Proc("gateway", gateway_command(args, port, args.eager), GATEWAY_ENV, logs / "gateway.log", port=port)
        if args.aa:
            targets[AA] = Again(targets["gateway"])
    if "vllm" in wanted:
        port = args.vllm_port or free_port()
        targets["vllm"] = Proc("vllm", vllm_command(args, port, args.eager), {}, logs / "vllm.log", port=port)
    if "engine" in wanted:
        targets["engine"] = EngineAlone(args, logs)
    return targets


async def _round(alive: list[Target], plan: Plan, args: argparse.Namespace, runs: list[dict[str, Any]],
                 client: VllmClient | None) -> None:
    for r in range(args.repeats):
        for i, level in enumerate(args.concurrency):
            shift = (r + i) % len(alive)  # who goes first rotates
            for t in alive[shift:] + alive[:shift]:
                runs.append(await measure(t, plan, args, r, level, [o for o in alive if o is not t and not isinstance(o, Again)], client))


async def race_targets(args: argparse.Namespace, logs: Path, notes: list[str], document: dict[str, Any]) -> None:
    wanted = [t for t in TARGETS if t in args.parts]
    if not wanted:
        return
    layout = choose_layout(args, notes, len(wanted)) if len(wanted) > 1 else "single"
    document["layout"] = layout
    targets = _targets(args, wanted, logs)
    runs: list[dict[str, Any]] = document.setdefault("runs", [])
    client = VllmClient(logs) if args.client == "vllm" and ("gateway" in wanted or "vllm" in wanted) else None
    plan: Plan | None = None
    names = list(targets)
    groups = [names] if layout == "interleaved" else [[n for n in names if n in (t, AA if t == "gateway" else t)] for t in wanted]
    try:
        if client is not None:
            client.start()
            log(f"vLLM's benchmark client ready in {float((await client.answer(600))['ready']):.0f} s")
        for group in groups:
            alive = [targets[t] for t in group]
            started = [t for t in alive if not isinstance(t, Again)]
            for t in started:
                t.start()
            startup = await asyncio.gather(*(t.wait_ready(args.start_timeout) for t in started))
            document.setdefault("startup_s", {}).update({t.name: round(s, 1) for t, s in zip(started, startup)})
            if plan is None:
                servers = [t for t in started if isinstance(t, Proc)]
                plan = await make_plan(args, servers[0].base_url if servers else None)
            for t in started:
                await (t.warm_up(plan, args) if isinstance(t, EngineAlone) else warm_up(t, plan, args))
            busy = busy_processes(exclude=[t.process.pid for t in started if t.process])
            if busy:
                notes.append("other processes were busy when the measurements started: " + "; ".join(busy[:5]))
                log(notes[-1])
            await _round(alive, plan, args, runs, client)
            for t in started:
                t.stop()
    finally:
        for t in targets.values():
            if not isinstance(t, Again):
                t.stop()
        if client is not None:
            client.stop()
