"""The batch lane's store backends side by side (issues 29, 38): what a batch costs with
`store.backend` disk (the default: records in SQLite, contents in local files), redis (records in a
real redis-server, AOF on with `appendfsync everysec` as docs/deployment.md recommends; contents in
local files) and s3 (contents in moto's S3 server, `tests/s3_server.py`: an in-memory stand-in on
loopback, one request at a time, a few ms a call; real S3 takes ~10-30 ms a round trip; records in
SQLite), against the same lines sent through the plain interactive path.

One gateway per backend (`python -m gateway serve --port 0`, its port read back from its log), each
serving one remote model: the instant endpoint (`benchmarks.instant_endpoint`, served in this
process), so a line costs next to nothing upstream and the store's cost shows. Per round, with the
openai SDK, in turns (who goes first rotating):

- `disk`, `disk-aa` (the same gateway measured again: the A/A, the noise floor), `redis`, `s3`: a
  batch of `--lines` short chat lines uploaded (the upload's time), created, watched until
  `completed` (lines/s from the first poll that sees it `in_progress` to the first that sees it
  `completed`, polls `--poll-s` apart at first, then every 2% of the time it has run, so that the
  polls' own store reads stay few; finalizing included) and its output downloaded (the download's time);
- `interactive`: the same lines as plain chat completions on the disk gateway, `--max-in-flight` at
  a time (the batch lane's `batches.max_in_flight`): lines/s.

Also each run's gateway CPU (user and system, from /proc) per line: steadier than lines/s on a shared machine.

Medians over `--rounds`, each backend's lines/s ÷ the interactive reference and ÷ disk (medians of
the per-round ratios, with their range), beside the A/A's disk-aa ÷ disk.

`--against PATH` (a worktree of an older tree, e.g. `git worktree add /tmp/old 3a87cdf`) adds, in the same
rounds, `old-disk` and `old-redis`: gateways of that tree (`python -P -m gateway`, its own PYTHONPATH, so the
working directory's package does not shadow it; Redis under a prefix of its own) and `redis-aa`, the A/A of redis:
then `÷ old` is disk ÷ old-disk and redis ÷ old-redis, each beside its A/A (disk-aa ÷ disk, redis-aa ÷ redis).

    .venv/bin/python -m benchmarks.store_backends --rounds 3 [--against /tmp/old]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from openai import AsyncOpenAI

from benchmarks import instant_endpoint
from benchmarks.procs import RESULTS, Proc, log, md_table, num, paired, rotated, run_command
from tests.ports import listening_line
from tests.redis_server import RedisServer
from tests.s3_server import S3Server

MODEL = "bare"
KEY = "sk-bench"
BACKENDS = ("disk", "redis", "s3")
OLD = "old-"  # the gateways of `--against`
ENDED = frozenset({"completed", "failed", "cancelled", "expired"})
METRICS = ("lines_s", "cpu_ms_line", "upload_s", "download_s")
MOTO_NOTE = ("s3 is moto's S3 server (tests/s3_server.py): an in-memory stand-in on loopback, one request at a "
             "time; its contents (the input, the output file) are a few uploads and downloads a batch, its lines "
             "are SQLite records: the upload and download times say what S3 adds, not what real S3 would give")


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description="The batch lane's store backends side by side",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--backends", nargs="+", choices=BACKENDS, default=list(BACKENDS), help="disk is always measured")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--lines", type=int, default=1000, help="lines of each batch (and requests of the reference)")
    p.add_argument("--tokens", type=int, default=16, help="max_tokens of each line (words of the instant answer)")
    p.add_argument("--max-in-flight", type=int, default=4, help="batches.max_in_flight, and the reference's concurrency")
    p.add_argument("--poll-s", type=float, default=0.05,
                   help="how often the batch's status is read, at least (else every 2%% of the time it has run)")
    p.add_argument("--pause", type=float, default=1.0, help="seconds of quiet before each run")
    p.add_argument("--start-timeout", type=float, default=120)
    p.add_argument("--against", type=Path, help="a tree whose disk and redis gateways run beside these")
    return p.parse_args(argv)


def batch_content(lines: int, tokens: int, tag: str) -> bytes:
    return b"".join(json.dumps({
        "custom_id": f"{tag}-{i}", "method": "POST", "url": "/v1/chat/completions",
        "body": {"model": MODEL, "messages": [{"role": "user", "content": f"{tag}, line {i}: say something"}],
                 "max_tokens": tokens},
    }).encode() + b"\n" for i in range(lines))


# ----------------------------------------------------------------------------------------------
# The servers


def store_env(backend: str, folder: Path, redis: RedisServer | None, s3: S3Server | None) -> dict[str, str]:
    """Every backend keeps something in files.dir and batches.dir (SQLite, contents, the spool): the run's folder."""
    dirs = {"GATEWAY_FILES__DIR": str(folder / "files"), "GATEWAY_BATCHES__DIR": str(folder / "batches")}
    if backend == "redis":
        assert redis is not None
        return {**dirs, "GATEWAY_STORE__BACKEND": "redis", "GATEWAY_STORE__REDIS_URL": redis.url}
    if backend == "s3":
        assert s3 is not None
        return {**dirs, "GATEWAY_STORE__BACKEND": "s3", "GATEWAY_STORE__S3_ENDPOINT_URL": s3.url,
                "GATEWAY_STORE__S3_BUCKET": s3.bucket(), "GATEWAY_STORE__S3_ACCESS_KEY_ID": "test",
                "GATEWAY_STORE__S3_SECRET_ACCESS_KEY": "test"}
    return dirs


def gateway(name: str, logs: Path, upstream: str, args: argparse.Namespace, redis: RedisServer | None,
            s3: S3Server | None) -> Proc:
    """A gateway whose one model is the instant endpoint, its batch lane on `backend`; `old-<backend>` one of the
    `--against` tree."""
    old, backend = name.startswith(OLD), name.removeprefix(OLD)
    folder = logs / name
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "keys.yaml").write_text(f"keys:\n  bench: {{key: {KEY}}}\n")
    models = folder / "models.yaml"
    models.write_text(f"models:\n  - {{name: {MODEL}, kind: remote, url: '{upstream}', upstream_model: {MODEL}}}\n")
    env = {"GATEWAY_KEYS_FILE": str(folder / "keys.yaml"), "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_WARMUP": "false",
           "GATEWAY_LOG_LEVEL": "info", "GATEWAY_LOG_FORMAT": "json", "GATEWAY_RATE_LIMIT_RPM": "100000000",
           "GATEWAY_BATCHES__MAX_IN_FLIGHT": str(args.max_in_flight), "GATEWAY_BATCHES__POLL_S": "0.2",
           **store_env(backend, folder, redis, s3)}
    if old:  # -P: no working directory first on sys.path, where this tree's package would shadow the old one
        env |= {"PYTHONPATH": str(args.against.resolve()), "GATEWAY_STORE__REDIS_PREFIX": "llm-gateway:old-store:"}
    command = [sys.executable, *(["-P"] if old else []), "-m", "gateway", "serve", "--models-file", str(models),
               "--port", "0"]
    return Proc(name, command, env, logs / f"{name}.log", api_key=KEY)


async def started(proc: Proc, timeout_s: float) -> Proc:
    """Started, its port read from its `listening` line, then ready."""
    proc.start()
    deadline = time.monotonic() + timeout_s
    while (found := listening_line(proc.log_path.read_text(errors="replace"))) is None:
        assert proc.process is not None
        if proc.process.poll() is not None or time.monotonic() > deadline:
            raise proc.failed("did not log the port it listens on")
        await asyncio.sleep(0.2)
    proc.port = found[1]
    await proc.wait_ready(timeout_s)
    return proc


# ----------------------------------------------------------------------------------------------
# The runs


def cpu_s(pid: int) -> float:
    """The CPU seconds (user and system) a process has used: what a line costs the gateway, whatever else runs on the
    machine meanwhile (its lines/s moves with the machine's load, this much less)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def batch_run(client: AsyncOpenAI, args: argparse.Namespace, tag: str) -> dict[str, float]:
    """One batch: uploaded, run, its output downloaded; the times of each."""
    content = batch_content(args.lines, args.tokens, tag)
    began = time.perf_counter()
    uploaded = await client.files.create(file=(f"{tag}.jsonl", content), purpose="batch")
    upload_s = time.perf_counter() - began
    batch = await client.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                        completion_window="24h")
    first = created = time.perf_counter()  # kept when no poll saw it in_progress (it ran between two)
    running = False
    while batch.status not in ENDED:
        await asyncio.sleep(min(1.0, max(args.poll_s, (time.perf_counter() - created) / 50)))  # ~2% of the run
        batch = await client.batches.retrieve(batch.id)
        if not running and batch.status != "validating":
            first = time.perf_counter() if batch.status == "in_progress" else first
            running = True
    ended = time.perf_counter()
    counts = batch.request_counts
    if batch.status != "completed" or counts is None or counts.completed != args.lines or batch.output_file_id is None:
        raise RuntimeError(f"batch {tag} did not complete cleanly: {batch.model_dump_json()}")
    began = time.perf_counter()
    output = (await client.files.content(batch.output_file_id)).content
    download_s = time.perf_counter() - began
    if (got := output.count(b"\n")) != args.lines:
        raise RuntimeError(f"batch {tag}: {got} output lines, not {args.lines}")
    return {"lines_s": args.lines / (ended - first), "run_s": ended - first, "upload_s": upload_s,
            "download_s": download_s, "create_to_completed_s": ended - created}


async def interactive_run(client: AsyncOpenAI, args: argparse.Namespace, tag: str) -> dict[str, float]:
    """The same lines as plain chat completions, `--max-in-flight` at a time."""
    queue = list(range(args.lines))

    async def worker() -> None:
        while queue:
            i = queue.pop()
            await client.chat.completions.create(model=MODEL, max_tokens=args.tokens,
                                                 messages=[{"role": "user", "content": f"{tag}, line {i}: say something"}])

    began = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(args.max_in_flight)))
    took = time.perf_counter() - began
    return {"lines_s": args.lines / took, "run_s": took}


async def warm_up(clients: dict[str, AsyncOpenAI], args: argparse.Namespace) -> None:
    small = argparse.Namespace(**{**vars(args), "lines": 8})
    for name, client in clients.items():
        await batch_run(client, small, f"warm-{name}")
        await interactive_run(client, small, f"warm-{name}")


async def work(args: argparse.Namespace, document: dict[str, Any]) -> None:
    logs = Path(document["logs"])
    backends = ["disk", *(b for b in args.backends if b != "disk")]
    olds = [OLD + b for b in ("disk", "redis") if b in backends] if args.against else []
    redis = RedisServer(logs, appendfsync="everysec").start() if "redis" in backends else None
    s3 = S3Server().start() if "s3" in backends else None
    mock = await instant_endpoint.serve(name=MODEL)
    upstream = f"http://127.0.0.1:{mock.sockets[0].getsockname()[1]}/v1"
    clients: dict[str, AsyncOpenAI] = {}
    try:
        procs = await asyncio.gather(*(started(gateway(b, logs, upstream, args, redis, s3), args.start_timeout)
                                       for b in (*backends, *olds)))
        clients = {b: AsyncOpenAI(base_url=p.base_url, api_key=KEY, max_retries=0, timeout=600)
                   for b, p in zip((*backends, *olds), procs, strict=True)}
        pids = {b: p.process.pid for b, p in zip((*backends, *olds), procs, strict=True) if p.process is not None}
        await warm_up(clients, args)
        twins = [("redis-aa", "redis")] if olds and "redis" in backends else []
        slots = [("disk", "disk"), ("disk-aa", "disk"), *((b, b) for b in backends[1:]), *twins,
                 *((b, b) for b in olds), ("interactive", "disk")]
        document["targets"] = [name for name, _ in slots]
        runs: list[dict[str, Any]] = document.setdefault("runs", [])
        for r in range(args.rounds):
            for name, backend in rotated(slots, r):
                await asyncio.sleep(args.pause)
                measure = interactive_run if name == "interactive" else batch_run
                cpu = cpu_s(pids[backend])
                metrics = await measure(clients[backend], args, f"r{r}-{name}")
                metrics["cpu_ms_line"] = (cpu_s(pids[backend]) - cpu) * 1000 / args.lines
                runs.append({"repeat": r, "concurrency": args.max_in_flight, "target": name, "metrics": metrics})
                log(f"round {r} {name}: " + ", ".join(f"{k} {v:.3g}" for k, v in metrics.items()))
    finally:
        for client in clients.values():
            await client.close()
        mock.close()
        for server in (redis, s3):
            if server is not None:
                server.stop()


# ----------------------------------------------------------------------------------------------
# The report


def summarize(document: dict[str, Any]) -> None:
    """Medians per target; each batch target's lines/s ÷ interactive and ÷ disk, the A/A's spread."""
    runs, targets = document.get("runs", []), document.get("targets", [])
    if not runs:
        return
    level = runs[0]["concurrency"]
    medians = paired(runs, level, "disk", METRICS)["medians"]
    rows = []
    for target in targets:
        row: dict[str, Any] = {"target": target, **medians.get(target, {}),
                               "lines_s_all": [r["metrics"]["lines_s"] for r in runs if r["target"] == target]}
        if target != "interactive":
            ratios = paired(runs, level, target, ("lines_s",))
            for other in ("interactive", "disk", "redis", OLD + target):
                if other != target and other in ratios["ratios"]:
                    row[f"vs_{other}"] = ratios["ratios"][other]["lines_s"]
                    row[f"vs_{other}_range"] = ratios["spread"][other]["lines_s"]
        rows.append(row)
    document["summary"] = rows


def render(document: dict[str, Any]) -> str:
    def ratio(row: dict[str, Any], other: str) -> str:
        value, spread = row.get(f"vs_{other}"), row.get(f"vs_{other}_range")
        return "-" if value is None or spread is None else f"{value:.2f} [{spread[0]:.2f}, {spread[1]:.2f}]"

    def against(row: dict[str, Any]) -> str:
        """÷ old, beside its A/A: disk-aa ÷ disk for disk, redis-aa ÷ redis for redis."""
        twin = next((r for r in document.get("summary", []) if r["target"] == f"{row['target']}-aa"), None)
        old = ratio(row, OLD + row["target"])
        return "-" if old == "-" or twin is None else f"{old} (A/A {ratio(twin, row['target'])})"

    rows = [(r["target"], f"{r['lines_s']:.0f} [{min(r['lines_s_all']):.0f}-{max(r['lines_s_all']):.0f}]",
             ratio(r, "interactive"), ratio(r, "disk"), against(r), num(r.get("cpu_ms_line"), 3),
             num(r.get("upload_s"), 3), num(r.get("download_s"), 3)) for r in document.get("summary", [])]
    return "\n".join([f"`{document['command']}`", "",
                      *md_table("target | lines/s median [range] | ÷ interactive [range] | ÷ disk [range] | "
                                "÷ old [range] (A/A [range]) | gateway CPU ms/line | upload s | download s", rows, left=("target",)),
                      "", "disk-aa ÷ disk is the A/A: the noise floor of every ratio (redis-aa ÷ redis beside ÷ old for "
                      "redis). " + MOTO_NOTE + "."])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    return run_command("store_backends", argv, parse(argv), work, render, RESULTS, finish=summarize)[0]


if __name__ == "__main__":
    sys.exit(main())
