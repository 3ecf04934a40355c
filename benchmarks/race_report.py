"""The race's report, functions of its document: medians, paired ratios and the targets
(procs.paired), the notes they call for, the markdown tables and benchmarks/RESULTS.md."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.loadgen.results import WANTED_HEADROOM
from benchmarks.procs import md_table, num, paired

SERVED_NAME = "smollm2-135m-instruct"
TARGETS = ("gateway", "gateway-aa", "vllm", "engine")  # the table's order; gateway-aa: the A/A twin
METRICS = ("output_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p99_ms", "e2e_p50_ms",
           "front_cpu_ms_per_token")  # medians and paired ratios (README.md, "The race", says what each is)
EXTRA = ("mean_output_tokens", "client_headroom", "e2e_p99_ms")  # medians kept, no ratios
# (metric, against, bound, higher is better): what the race is judged on
TARGET_RULES = [("output_tok_s", "vllm", 1.00, True), ("output_tok_s", "engine", 0.95, True),
                ("ttft_p50_ms", "vllm", 1.00, False), ("ttft_p99_ms", "vllm", 1.00, False)]
ECHO_BOUND = 0.5  # the gateway's own cost: at least half of the bare stack's rate
ECHO_NAMES = ("echo", "echo-aa", "bare")
KEEP_MARKER = "<!-- Written by hand: race.py --write-results-md keeps what follows. -->"


def summarize(runs: Sequence[dict[str, Any]], levels: Sequence[int], reference: str = "gateway") -> list[dict[str, Any]]:
    """Per level: procs.paired's medians and ratios, and the targets met or missed."""
    rows = []
    for level in levels:
        row = paired(runs, level, reference, METRICS, EXTRA)
        row["targets"] = {}
        for name, against, bound, higher in TARGET_RULES:
            if (value := row["ratios"].get(against, {}).get(name)) is not None:
                row["targets"][f"{name} vs {against}"] = {"ratio": value, "bound": bound,
                                                          "met": value >= bound if higher else value <= bound}
        rows.append(row)
    return rows


def within(value: float | None, floor: Sequence[float] | None) -> bool | None:
    """Whether a ratio lies inside the A/A noise band: symmetric about 1.0 and as wide as the A/A
    ratios strayed either way ([1/m, m], m the largest of hi and 1/lo: an A/A 0.9 says 1.1 could come as easily)."""
    if value is None or floor is None or floor[0] <= 0:
        return None
    m = max(floor[1], 1 / floor[0], 1.0)
    return 1 / m <= value <= m


def spread_text(row: dict[str, Any], name: str, other: str) -> str:
    """A ratio as median [smallest, largest]."""
    value, floor = row["ratios"].get(other, {}).get(name), row["spread"].get(other, {}).get(name)
    return "-" if value is None else f"{value:.3f} [{floor[0]:.3f}, {floor[1]:.3f}]" if floor else f"{value:.3f}"


def _vs(row: dict[str, Any], name: str, other: str, aa: str, bound: float | None = None, higher: bool = True) -> str:
    """The ratio to `other`, ✓/✗ against the bound, ≈ when it lies within the A/A noise band."""
    value = row["ratios"].get(other, {}).get(name)
    if value is None:
        return "-"
    met = "" if bound is None else " ✓" if (value >= bound if higher else value <= bound) else " ✗"
    return f"{value:.3f}{met}" + (" ≈" if within(value, row["spread"].get(aa, {}).get(name)) else "")


BOUNDS = {(name, against): (bound, higher) for name, against, bound, higher in TARGET_RULES}
RATIO_ROWS = ("output_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms")
CELLS = ("output_tok_s", "req_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "itl_p99_ms", "e2e_p50_ms", "mean_output_tokens")


def _model_tables(document: dict[str, Any]) -> list[str]:
    rows = document.get("summary", [])
    if not rows:
        return []
    medians = [[row["concurrency"], target, *(num(m[c], 2 if c == "req_s" else 1) for c in CELLS), m["failed"],
                num(m.get("front_cpu_ms_per_token"), 3), num(m.get("client_headroom"))]
               for row in rows for target in TARGETS if (m := row["medians"].get(target))]
    ratios = [[row["concurrency"], name, *(_vs(row, name, other, "gateway-aa", *BOUNDS.get((name, other), (None, True)))
                                           for other in ("vllm", "engine")), spread_text(row, name, "gateway-aa")]
              for row in rows for name in RATIO_ROWS]
    return [
        (f"Medians over {document['settings']['repeats']} repetition(s), client: {document['settings'].get('client', 'ours')}; "
         "gateway-aa: the same gateway measured again in each round (A/A); engine: AsyncLLM in-process without HTTP; "
         "client headroom: the client's ceiling (the same load against the instant endpoint) ÷ the run's req/s."),
        "",
        *md_table("concurrency | target | output tok/s | req/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p99 ms | "
                  "e2e p50 ms | out tokens | failed | front-end CPU ms/token | client headroom", medians, left=("target",)),
        "",
        ("Ratios gateway ÷ other, medians of the per-repetition ratios (tok/s: higher is better; latencies: lower). "
         "✓/✗: the targets (tok/s ≥ 1.00× vLLM's server and ≥ 0.95× the engine alone; TTFT ≤ 1.00× vLLM's server). "  # noqa: RUF001 - the multiplication sign is deliberate
         "A/A: gateway ÷ gateway-aa, median [smallest, largest], the noise floor; ≈: not told apart from it."),
        "",
        *md_table("concurrency | metric | ÷ vllm | ÷ engine | A/A (noise floor)", ratios, left=("metric",)),
    ]


def echo_metric(scenario: str) -> str:
    """Streams are judged on chunks (one token each) per second, the rest on requests per second."""
    return "output_tok_s" if scenario == "stream" else "req_s"


def echo_summary(document: dict[str, Any]) -> dict[str, list[dict[str, Any]]]:
    """Per scenario: summarize() of the echo part with the echo gateway as the reference."""
    runs = document.get("echo_runs") or []
    levels = sorted({r["concurrency"] for r in runs})
    scenarios = dict.fromkeys(r["scenario"] for r in runs)
    return {s: summarize([r for r in runs if r["scenario"] == s], levels, reference="echo") for s in scenarios}


def _echo_tables(document: dict[str, Any]) -> list[str]:
    rows = []
    for scenario, levels in (document.get("echo_summary") or {}).items():
        metric = echo_metric(scenario)
        for row in levels:
            m = {t: row["medians"].get(t, {}) for t in ECHO_NAMES}
            rows.append([scenario, row["concurrency"], "chunks/s" if metric == "output_tok_s" else "req/s",
                         *(num(m[t].get(metric)) for t in ECHO_NAMES), _vs(row, metric, "bare", "echo-aa", ECHO_BOUND),
                         spread_text(row, metric, "echo-aa"), num(m["echo"].get("e2e_p50_ms"), 2),
                         num(m["bare"].get("e2e_p50_ms"), 2), sum(m[t].get("failed", 0) for t in ECHO_NAMES),
                         f"{num(m['echo'].get('client_headroom'))} / {num(m['bare'].get('client_headroom'))}"])
    return [] if not rows else [
        "",
        ("The gateway's own cost: echo = the gateway on the echo engine as deployed (access logs, metrics, an API key, "
         "the memory response cache), echo-aa = the same process again (A/A), bare = Starlette + uvicorn answering a "
         f"fixed completion. Wanted: echo ÷ bare ≥ {ECHO_BOUND}. Client headroom: its ceiling ÷ echo's and bare's rates."),
        "",
        *md_table("scenario | concurrency | rate | echo | echo-aa | bare | echo ÷ bare | A/A (noise floor) | echo e2e p50 ms | "
                  "bare e2e p50 ms | failed | client headroom, echo / bare", rows, left=("scenario", "rate")),
    ]


def markdown(document: dict[str, Any]) -> str:
    lines = _model_tables(document) + _echo_tables(document)
    if notes := document.get("notes"):
        lines += ["", "Notes:", "", *(f"- {n}" for n in notes)]
    return "\n".join(lines) + "\n"


def results_md(document: dict[str, Any], json_name: str) -> str:
    m, s = document["machine"], document["settings"]
    return "\n".join([
        "# Benchmark results", "",
        (f"The latest race ({document['started']}), written by `benchmarks/race.py --write-results-md`; raw numbers in "
         f"`benchmarks/results/{json_name}` (not committed). What the numbers mean: [README.md](README.md)."), "",
        "## Machine", "",
        (f"- {m['nproc']} CPU cores usable ({m['cpu_model']}{', AVX-512' if m['avx512'] else ''}), "
         f"{m['memory_gib']} GiB memory, no GPU, Linux {m['kernel']}"),
        f"- load average at start: {', '.join(f'{x:.2f}' for x in m['loadavg'])}",
        "- versions: " + ", ".join(f"{k} {val}" for k, val in document["versions"].items() if val), "",
        "## Settings", "",
        (f"- model: `{s['model']}` served as `{SERVED_NAME}`; dtype {s['dtype']}, max_model_len {s['max_model_len']}, "
         f"kv_cache_memory_bytes {s['kv_cache_memory_bytes']}, {'eager' if s['eager'] else 'compiled (torch.compile)'}"),
        (f"- load: {s['endpoint']} endpoint, streaming, {s['input_tokens']}-token prompts, {s['output_tokens']} output "
         f"tokens (ignore_eos), temperature 0, concurrency {', '.join(map(str, s['concurrency']))}, "
         f"{s['waves']} × concurrency (at least 16) requests per run, {s['repeats']} repetition(s), "  # noqa: RUF001 - deliberate
         f"targets {document.get('layout', '?')}"), "",
        "## Command", "", "```sh", document["command"], "```", "",
        "## Results", "", markdown(document),
    ])


def kept_part(results: Path) -> str:
    """What follows KEEP_MARKER in the RESULTS.md being replaced, so a new race does not wipe it."""
    text = results.read_text() if results.exists() else ""
    at = text.find(KEEP_MARKER)
    return "" if at < 0 else "\n" + text[at:]


def finish(document: dict[str, Any], args: Any) -> None:
    """The summaries, and the notes they call for."""
    for key, empty in (("complete", False), ("runs", []), ("notes", [])):
        document.setdefault(key, empty)  # a race stopped before it began
    notes = document["notes"]
    document["summary"] = summarize(document["runs"], args.concurrency) if document["runs"] else []
    for row in document["summary"]:
        notes += [f"c={row['concurrency']}: {name} = {rule['ratio']:.3f} misses the target {rule['bound']:.2f}"
                  for name, rule in row["targets"].items() if not rule["met"]]
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
    where, wanted = f"{prefix}c={row['concurrency']}", WANTED_HEADROOM
    for target, m in row["medians"].items():
        made = m.get("mean_output_tokens")
        if output_tokens is not None and made is not None and abs(made - output_tokens) > 0.5:
            notes.append(f"{where}: {target} produced {made:.1f} tokens per request, not {output_tokens} (ignore_eos not honoured?)")
        if m.get("failed"):
            notes.append(f"{where}: {target} had {m['failed']} failed or cancelled request(s)")
        if (headroom := m.get("client_headroom")) is not None and headroom < wanted:
            notes.append(f"{where}: the client's ceiling was only {headroom:.1f}x {target}'s rate "
                         f"(wanted {wanted:.0f}x): the client may be part of that measurement")
