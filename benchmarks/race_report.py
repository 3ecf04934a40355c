"""The race's report: its numbers (medians, paired ratios, the targets) and how they are written
(the markdown tables, benchmarks/RESULTS.md, the plot). Pure functions of the race's document."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from benchmarks import loadgen

SERVED_NAME = "smollm2-135m-instruct"
TARGETS = ("gateway", "vllm", "engine")

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


def num(value: float | None, digits: int = 1) -> str:
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
                    f"| {row['concurrency']} | {target} | {num(m['output_tok_s'])} | {num(m['req_s'], 2)} | "
                    f"{num(m['ttft_p50_ms'])} | {num(m['ttft_p99_ms'])} | {num(m['tpot_p50_ms'])} | {num(m['itl_p99_ms'])} | "
                    f"{num(m['e2e_p50_ms'])} | {num(m['mean_output_tokens'])} | {m['failed']} | {num(m.get('front_cpu_ms_per_token'), 3)} |"
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
                f"| {item['scenario']} | {item['concurrency']} | {item['requests']} | {num(m['req_s'])} | {num(m['output_tok_s'])} | "
                f"{num(m['ttft_p50_ms'], 2)} | {num(m['e2e_p50_ms'], 2)} | {num(m.get('e2e_p99_ms'), 2)} | {item.get('note', '')} |"
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
