"""The race: the gateway against vLLM's own server and the engine alone, each ratio beside its A/A
noise floor, and the gateway's own cost against the bare stack (benchmarks/README.md, "The race").

    python -m benchmarks.race [--repeats 3] [--concurrency 1 4 16 64] [--eager] [--client ours|vllm]
                              [--parts gateway vllm engine echo] [--no-aa] [--write-results-md]

The model part is race_models.py, the echo part race_echo.py, the numbers and tables race_report.py.
"""

from __future__ import annotations

import argparse
import json
import shlex
import signal
import sys
from pathlib import Path
from typing import Any

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


from benchmarks import loadgen
from benchmarks.procs import REPO, STARTED, busy_processes, log, machine, versions
from benchmarks.race_echo import echo_options, run_echo
from benchmarks.race_models import race_targets
from benchmarks.race_report import ECHO_BOUND, echo_summary, kept_part, markdown, plot, results_md, streamed, summarize
from benchmarks.race_servers import gateway_command, prepare_model, vllm_command

__all__ = ["gateway_command", "main", "parser", "vllm_command"]

BENCH = REPO / "benchmarks"
PARTS = ("gateway", "vllm", "engine", "echo")


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
    p.add_argument("--client", choices=["ours", "vllm"], default="ours",
                   help="the servers' client: benchmarks.loadgen, or vLLM's `vllm bench serve` (benchmarks.vllm_bench)")
    p.add_argument("--no-aa", dest="aa", action="store_false", help="no A/A twin (gateway-aa, echo-aa)")
    p.add_argument("--ceiling-duration", type=float, default=2.0,
                   help="after every server run: seconds of the same load against the instant endpoint (0: none)")
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
    echo_options(p)
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
    if "echo" in args.parts:
        await run_echo(args, logs, document)
    document["complete"] = True


def finish(document: dict[str, Any], args: argparse.Namespace) -> None:
    """The summaries and the notes they call for."""
    notes = document["notes"]
    document["summary"] = summarize(document["runs"], args.concurrency) if document["runs"] else []
    for row in document["summary"]:
        for name, rule in row["targets"].items():
            if not rule["met"]:
                notes.append(f"c={row['concurrency']}: {name} = {rule['ratio']:.3f} misses the target {rule['bound']:.2f}")
        _target_notes(notes, row, args.output_tokens)
    document["echo_summary"] = echo_summary(document)
    for scenario, rows in document["echo_summary"].items():
        metric = "output_tok_s" if streamed(scenario) else "req_s"
        for row in rows:
            value = row["ratios"].get("bare", {}).get(metric)
            if value is not None and value < ECHO_BOUND:
                notes.append(f"echo {scenario} c={row['concurrency']}: echo ÷ bare {metric} = {value:.3f}, below {ECHO_BOUND}")
            _target_notes(notes, row, None, f"echo {scenario} ")
    if not document["complete"]:
        notes.append(f"INCOMPLETE: {document.get('error', 'interrupted')}")


def _target_notes(notes: list[str], row: dict[str, Any], output_tokens: int | None, prefix: str = "") -> None:
    """Failures, wrong answer lengths and a client too close to its ceiling, per target."""
    where = f"{prefix}c={row['concurrency']}"
    for target, m in row["medians"].items():
        if output_tokens is not None and m.get("mean_output_tokens") is not None and abs(m["mean_output_tokens"] - output_tokens) > 0.5:
            notes.append(f"{where}: {target} produced {m['mean_output_tokens']:.1f} tokens per request, "
                         f"not {output_tokens} (ignore_eos not honoured?)")
        if m.get("failed"):
            notes.append(f"{where}: {target} had {m['failed']} failed or cancelled request(s)")
        headroom = m.get("client_headroom")
        if headroom is not None and headroom < loadgen.ceiling.WANTED_HEADROOM:
            notes.append(f"{where}: the client's ceiling was only {headroom:.1f}x {target}'s rate "
                         f"(wanted {loadgen.ceiling.WANTED_HEADROOM:.0f}x): the client may be part of that measurement")


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
        loadgen.run_async(race(args, document))
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
    if document["runs"] or document.get("echo_runs"):
        write_outputs(document, args)
    return code


if __name__ == "__main__":
    sys.exit(main())
