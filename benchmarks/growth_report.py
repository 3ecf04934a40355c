"""benchmarks.growth's document as markdown tables (one per part measured)."""

from __future__ import annotations

from typing import Any


def _n(value: Any, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _prompt(rows: list[dict[str, Any]]) -> list[str]:
    lines = ["| prompt tokens | prompts | mean input tokens | TTFT p50 ms | TTFT p99 ms | e2e p50 ms | req/s | gateway CPU ms/request | failed |",
             "|---:|---|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['tokens']} | {r['prompts']} | {_n(r['mean_input_tokens'])} | {_n(r['ttft_p50_ms'], 2)} | "
                     f"{_n(r['ttft_p99_ms'], 2)} | {_n(r['e2e_p50_ms'], 2)} | {_n(r['req_s'])} | "
                     f"{_n(r['gateway_cpu_ms_per_request'], 3)} | {r['failed']} |")
    return lines


def _streams(s: dict[str, Any]) -> list[str]:
    held, idle = s["loop_lag_held"], s["loop_lag_idle"]
    return [
        "| streams held | RSS before MiB | RSS held MiB | KiB per open stream | loop lag idle p99 / max ms | loop lag held p50 / p99 / max ms | GET /health p50 / p99 / max ms | failed |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
        (f"| {s['streams']} | {_n(s['rss_before_mib'])} | {_n(s['rss_held_mib'])} | {_n(s['kib_per_stream'])} | "
         f"{_n(idle.get('p99_ms'), 2)} / {_n(idle.get('max_ms'), 2)} | {_n(held.get('p50_ms'), 2)} / {_n(held.get('p99_ms'), 2)} / "
         f"{_n(held.get('max_ms'), 2)} | {_n(s['health_p50_ms'], 2)} / {_n(s['health_p99_ms'], 2)} / {_n(s['health_max_ms'], 2)} | "
         f"{s['load']['failed']} |"),
    ]


def _cache(c: dict[str, Any]) -> list[str]:
    small, full = c["hit_nearly_empty"], c["hit_full"]
    return [
        "| entries | tokens per answer | RSS before MiB | RSS after MiB | bytes per entry | hit e2e p50 / p99 ms, 10 entries | hit e2e p50 / p99 ms, full | hits counted |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
        (f"| {c['entries']} | {c['answer_tokens']} | {_n(c['rss_before_mib'])} | {_n(c['rss_after_mib'])} | "
         f"{_n(c['bytes_per_entry'], 0)} | {_n(small['e2e_p50_ms'], 3)} / {_n(small['e2e_p99_ms'], 3)} | "
         f"{_n(full['e2e_p50_ms'], 3)} / {_n(full['e2e_p99_ms'], 3)} | {full['x_cache']} |"),
    ]


def _soak(s: dict[str, Any]) -> list[str]:
    points = ", ".join(f"{p['requests']}: {p['rss_mib']:.0f}" for p in s["points"])
    lines = [f"- {s['requests']} requests ({s['failed']} failed); RSS (MiB) after each step: {points}"]
    if s.get("rss_at_bound_mib") is None:
        return lines + [f"- the cache's bound ({s['cache_bound_entries']} entries) was not reached: growth after it not measured"]
    return lines + [
        (f"- RSS when the cache reached its bound ({s['cache_bound_entries']} entries): {s['rss_at_bound_mib']:.1f} MiB; "
         f"at the end: {s['rss_end_mib']:.1f} MiB; growth after the bound: {s['growth_after_bound_mib']:+.1f} MiB"),
    ]


def markdown(document: dict[str, Any]) -> str:
    lines = [f"Growth ({document['started']}): `{document['command']}`", ""]
    sections = (("prompt", "Cost against prompt length", _prompt), ("streams", "Open idle streams", _streams),
                ("cache", "Cached entries", _cache), ("soak", "Memory over many requests (echo engine)", _soak))
    for key, title, render in sections:
        if document.get(key):
            lines += [f"### {title}", "", *render(document[key]), ""]
    if document.get("error"):
        lines.append(f"INCOMPLETE: {document['error']}")
    return "\n".join(lines) + "\n"
