"""The race's report: its numbers (medians, paired ratios, the targets, the notes they call for) and
how they are written (the markdown tables, benchmarks/RESULTS.md, the plot). Functions of the race's
document."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks import loadgen
from benchmarks.procs import md_table

SERVED_NAME = "smollm2-135m-instruct"
TARGETS = ("gateway", "gateway-aa", "vllm", "engine")  # the table's order; gateway-aa: the A/A twin

# medians and paired ratios of these (README.md, "The race", says what each is)
METRICS = ("output_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p99_ms", "e2e_p50_ms",
           "front_cpu_ms_per_token")
LATENCIES = (("ttft", "p50"), ("ttft", "p99"), ("tpot", "p50"), ("itl", "p99"), ("e2e", "p50"), ("e2e", "p99"))
EXTRA = ("mean_output_tokens", "client_headroom", "e2e_p99_ms")  # medians kept, no ratios
# (metric, against, bound, higher is better): what the race is judged on
TARGET_RULES = [("output_tok_s", "vllm", 1.00, True), ("output_tok_s", "engine", 0.95, True),
                ("ttft_p50_ms", "vllm", 1.00, False), ("ttft_p99_ms", "vllm", 1.00, False)]


def metrics_of(result: dict[str, Any]) -> dict[str, float | None]:
    """The race's numbers from a Result.to_dict()."""
    latencies = {f"{stat}_{p}_ms": (result.get(stat) or {}).get(p) for stat, p in LATENCIES}
    return {"output_tok_s": result.get("output_throughput"), "req_s": result.get("request_throughput"),
            **{name: None if s is None else s * 1000 for name, s in latencies.items()},
            "mean_output_tokens": result.get("mean_output_tokens"),
            "failed": result.get("failed", 0) + result.get("cancelled", 0),
            "client_headroom": (result.get("ceiling") or {}).get("headroom")}  # the client's ceiling ÷ this run


def median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return statistics.median(present) if present else None


def ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or not b else a / b


def summarize(runs: Sequence[dict[str, Any]], levels: Sequence[int], reference: str = "gateway") -> list[dict[str, Any]]:
    """Per level: medians over repetitions per target, and the reference's ratios to every other.

    All targets take their runs of a repetition one after the other (interleaved), so the ratio
    against each is the median of the per-repetition (paired) ratios: slow drifts of the machine
    between repetitions cancel out. `spread` keeps the smallest and largest paired ratio: for the
    A/A twin that range is the noise floor.
    """
    rows = []
    for level in levels:
        by_target: dict[str, dict[int, dict[str, Any]]] = {}
        for run in runs:
            if run["concurrency"] == level:
                by_target.setdefault(run["target"], {})[run["repeat"]] = run["metrics"]
        medians = {
            target: {name: median([m.get(name) for m in reps.values()]) for name in [*METRICS, *EXTRA]}
            | {"failed": sum(m.get("failed") or 0 for m in reps.values()), "repeats": len(reps)}
            for target, reps in by_target.items()
        }
        ours = by_target.get(reference, {})
        paired = {
            other: {name: [x for r in ours if r in theirs if (x := ratio(ours[r].get(name), theirs[r].get(name))) is not None]
                    for name in METRICS}
            for other, theirs in by_target.items() if other != reference and ours
        }
        ratios = {other: {name: median(values) for name, values in p.items()} for other, p in paired.items()}
        spread = {other: {name: (min(v), max(v)) if v else None for name, v in p.items()} for other, p in paired.items()}
        targets = {}
        for name, against, bound, higher in TARGET_RULES:
            value = ratios.get(against, {}).get(name)
            if value is not None:
                targets[f"{name} vs {against}"] = {"ratio": value, "bound": bound, "met": value >= bound if higher else value <= bound}
        rows.append({"concurrency": level, "medians": medians, "ratios": ratios, "spread": spread, "targets": targets})
    return rows


def within(value: float | None, floor: tuple[float, float] | None) -> bool | None:
    """Whether a ratio lies inside the A/A noise band (so it cannot be told from noise): the band
    is symmetric about 1.0 and as wide as the A/A ratios strayed either way ([1/m, m], m the
    largest of hi and 1/lo), since an A/A ratio of 0.9 says 1.1 could come as easily."""
    if value is None or floor is None or floor[0] <= 0:
        return None
    m = max(floor[1], 1 / floor[0], 1.0)
    return 1 / m <= value <= m


def num(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def _aa(row: dict[str, Any], name: str, aa: str) -> str:
    value = row["ratios"].get(aa, {}).get(name)
    floor = row["spread"].get(aa, {}).get(name)
    return "-" if value is None else f"{value:.3f} [{floor[0]:.3f}, {floor[1]:.3f}]" if floor else f"{value:.3f}"


def _vs(row: dict[str, Any], name: str, other: str, aa: str, bound: float | None = None, higher: bool = True) -> str:
    """The ratio to `other`, ✓/✗ against the bound, ≈ when it lies within the A/A noise band."""
    value = row["ratios"].get(other, {}).get(name)
    if value is None:
        return "-"
    met = "" if bound is None else " ✓" if (value >= bound if higher else value <= bound) else " ✗"
    return f"{value:.3f}{met}" + (" ≈" if within(value, row["spread"].get(aa, {}).get(name)) else "")


RATIO_ROWS = (("output_tok_s", 1.00, 0.95, True), ("ttft_p50_ms", 1.00, None, False),
              ("ttft_p99_ms", 1.00, None, False), ("tpot_p50_ms", None, None, False))


def _model_tables(document: dict[str, Any]) -> list[str]:
    rows = document.get("summary", [])
    if not rows:
        return []
    cells = ("output_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p99_ms", "e2e_p50_ms", "mean_output_tokens")
    medians = [[row["concurrency"], target, *(num(m[c], 2 if c == "req_s" else 1) for c in cells), m["failed"],
                num(m.get("front_cpu_ms_per_token"), 3), num(m.get("client_headroom"))]
               for row in rows for target in TARGETS if (m := row["medians"].get(target))]
    ratios = [[row["concurrency"], name, _vs(row, name, "vllm", "gateway-aa", vllm_bound, higher),
               _vs(row, name, "engine", "gateway-aa", engine_bound, higher), _aa(row, name, "gateway-aa")]
              for row in rows for name, vllm_bound, engine_bound, higher in RATIO_ROWS]
    return [
        (f"Medians over {document['settings']['repeats']} repetition(s), client: {document['settings'].get('client', 'ours')}; "
         "gateway = this gateway, gateway-aa = the same gateway measured again in each round (A/A), vllm = vLLM's OpenAI "
         "server, engine = AsyncLLM in-process without HTTP. Client headroom: the client's ceiling (the same load against "
         "the instant endpoint) ÷ the run's req/s."),
        "",
        *md_table("concurrency | target | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p99 ms | "
                  "e2e p50 ms | out tokens | failed | front-end CPU ms/token | client headroom", medians, left=("target",)),
        "",
        ("Ratios gateway ÷ other, each the median of the per-repetition (paired) ratios; tok/s: higher is better, "
         "latencies: lower is better. ✓/✗: the targets (tok/s ≥ 1.00× vLLM's server and ≥ 0.95× the engine alone; "  # noqa: RUF001 - the multiplication sign is deliberate typography in RESULTS.md
         "TTFT p50/p99 ≤ 1.00× vLLM's server). A/A: gateway ÷ gateway-aa, median [smallest, largest per-repetition "  # noqa: RUF001 - the multiplication sign is deliberate typography in RESULTS.md
         "ratio], the noise floor; ≈ marks a ratio no farther from 1.0 than the A/A ratios strayed (not told "
         "apart from noise)."),
        "",
        *md_table("concurrency | metric | ÷ vllm | ÷ engine | A/A (noise floor)", ratios, left=("metric",)),
    ]


ECHO_BOUND = 0.5  # the gateway's own cost: at least half of the bare stack's rate
ECHO_NAMES = ("echo", "echo-aa", "bare")


def echo_metric(scenario: str) -> str:
    """Streams are judged on chunks (one token each, for echo and bare alike) per second, the rest on
    requests per second (a replayed cache hit streams one chunk per choice)."""
    return "output_tok_s" if scenario == "stream" else "req_s"


def echo_summary(document: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per scenario: summarize() of the echo part with the echo gateway as the reference."""
    runs = document.get("echo_runs") or []
    levels = sorted({r["concurrency"] for r in runs})
    scenarios = list(dict.fromkeys(r["scenario"] for r in runs))
    return {s: summarize([r for r in runs if r["scenario"] == s], levels, reference="echo") for s in scenarios}


def _echo_tables(document: dict[str, Any]) -> list[str]:
    summary = document.get("echo_summary") or {}
    if not summary:
        return []
    rows = []
    for scenario, levels in summary.items():
        metric = echo_metric(scenario)
        for row in levels:
            m = {t: row["medians"].get(t, {}) for t in ECHO_NAMES}
            rows.append([scenario, row["concurrency"], "chunks/s" if metric == "output_tok_s" else "req/s",
                         *(num(m[t].get(metric)) for t in ECHO_NAMES), _vs(row, metric, "bare", "echo-aa", ECHO_BOUND),
                         _aa(row, metric, "echo-aa"), num(m["echo"].get("e2e_p50_ms"), 2), num(m["bare"].get("e2e_p50_ms"), 2),
                         sum(m[t].get("failed", 0) for t in ECHO_NAMES),
                         f"{num(m['echo'].get('client_headroom'))} / {num(m['bare'].get('client_headroom'))}"])
    return [
        "",
        ("The gateway's own cost, where no model works: echo = the gateway on the instant echo engine with access "
         "logs, metrics, an API key and request ids on (and the memory response cache: the non-stream and stream "
         "runs send new temperature-0 requests, each a cache miss and store); echo-aa = the same process again (A/A); "
         "bare = Starlette + uvicorn answering a fixed completion (the stack's limit). Rates: req/s, for streams "
         f"chunks (tokens)/s. Wanted: echo ÷ bare ≥ {ECHO_BOUND}; A/A: echo ÷ echo-aa median [smallest, largest]. "
         "Client headroom: the client's ceiling (the same load against the instant endpoint, after every run) ÷ "
         "echo's and bare's rates, medians."),
        "",
        *md_table("scenario | concurrency | rate | echo | echo-aa | bare | echo ÷ bare | A/A (noise floor) | echo e2e p50 ms | "
                  "bare e2e p50 ms | failed | client headroom, echo / bare", rows, left=("scenario", "rate")),
    ]


def markdown(document: dict[str, Any]) -> str:
    lines = _model_tables(document) + _echo_tables(document)
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
         f"max({s['min_requests']}, {s['waves']} × concurrency) requests per run, {s['repeats']} repetition(s), "  # noqa: RUF001 - the multiplication sign is deliberate typography in RESULTS.md
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
    text = results.read_text() if results.exists() else ""
    at = text.find(KEEP_MARKER)
    return "" if at < 0 else "\n" + text[at:]


def plot(document: dict[str, Any], path: Path) -> Path | None:
    """The medians as loadgen.plot_sweep draws a sweep: one series per target."""
    series: dict[str, list[dict[str, Any]]] = {}
    for row in document.get("summary", []):
        for target, m in row["medians"].items():
            if m.get("output_tok_s") is not None:
                series.setdefault(target, []).append({**m, "concurrency": row["concurrency"]})
    return loadgen.plot_sweep(series, path, title="gateway vs vLLM's server vs engine alone (medians)") if series else None


# ----------------------------------------------------------------------------------------------
# Notes


def finish(document: dict[str, Any], args: Any) -> None:
    """The summaries, and the notes they call for."""
    for key, empty in (("complete", False), ("runs", []), ("notes", [])):
        document.setdefault(key, empty)  # a race stopped before it began
    notes = document["notes"]
    document["summary"] = summarize(document["runs"], args.concurrency) if document["runs"] else []
    for row in document["summary"]:
        for name, rule in row["targets"].items():
            if not rule["met"]:
                notes.append(f"c={row['concurrency']}: {name} = {rule['ratio']:.3f} misses the target {rule['bound']:.2f}")
        target_notes(notes, row, args.output_tokens)
    document["echo_summary"] = echo_summary(document)
    for scenario, rows in document["echo_summary"].items():
        metric = echo_metric(scenario)
        for row in rows:
            value = row["ratios"].get("bare", {}).get(metric)
            if value is not None and value < ECHO_BOUND:
                notes.append(f"echo {scenario} c={row['concurrency']}: echo ÷ bare {metric} = {value:.3f}, below {ECHO_BOUND}")
            target_notes(notes, row, None, f"echo {scenario} ")
    if not document["complete"]:
        notes.append(f"INCOMPLETE: {document.get('error', 'interrupted')}")


def target_notes(notes: list[str], row: dict[str, Any], output_tokens: int | None, prefix: str = "") -> None:
    """Failures, wrong answer lengths and a client too close to its ceiling, per target."""
    where = f"{prefix}c={row['concurrency']}"
    wanted = loadgen.WANTED_HEADROOM
    for target, m in row["medians"].items():
        made = m.get("mean_output_tokens")
        if output_tokens is not None and made is not None and abs(made - output_tokens) > 0.5:
            notes.append(f"{where}: {target} produced {made:.1f} tokens per request, not {output_tokens} (ignore_eos not honoured?)")
        if m.get("failed"):
            notes.append(f"{where}: {target} had {m['failed']} failed or cancelled request(s)")
        headroom = m.get("client_headroom")
        if headroom is not None and headroom < wanted:
            notes.append(f"{where}: the client's ceiling was only {headroom:.1f}x {target}'s rate "
                         f"(wanted {wanted:.0f}x): the client may be part of that measurement")
