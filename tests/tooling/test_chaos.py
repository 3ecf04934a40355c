"""benchmarks/chaos.py without the engine: how it reads streams and writes its figures (the drills
themselves run with `make chaos`)."""

from __future__ import annotations

from pathlib import Path

from benchmarks.chaos import markdown, write_md
from benchmarks.chaos_drills import Outcome

RESULTS = {
    "when": "2026-11-30 12:00", "machine": {"nproc": 2}, "versions": {"llm-gateway commit": "abc123"},
    "flood": {"sent": 80, "admitted": 8, "admitted_complete": 8, "refused_429": 72, "refused_before_first_byte": 72,
              "other": 0, "peak_engine_running": 4.0, "bound": {"running": 4, "waiting": 4}},
    "disconnects": {"disconnected_mid_stream": 100, "other_statuses": [], "engine_running_after": 0.0,
                    "gateway_in_flight_after": 0.0, "seconds_to_idle": 0.2, "disconnects_counted": 100.0},
    "redis_outage": {"phases": {p: {"ok": 10, "failed": 0, "hits": 5} for p in ("before", "down", "after")},
                     "failed": 0, "failures": [], "cache_errors_counted": 12.0},
    "sigterm": {"in_progress_at_sigterm": 4, "completed": 4, "lost": 0, "ready_while_draining": 503,
                "new_request_while_draining": 503, "exit_code": 0, "seconds_to_exit": 6.1},
    "upstream_killed": {"streams_cut": 4, "ended_with_one_error_event_and_done": 4, "error_message": "x",
                        "new_requests": 6, "served_by_fallback": 6, "ready_says": "unavailable: upstream unreachable"},
    "engine_killed": {"served_before_by": "smol", "seconds_to_liveness_503": 1.2, "health_after": 503,
                      "requests_after": 10, "served_by_fallback": 10},
}


def test_an_outcome_reads_done_errors_and_usage() -> None:
    outcome = Outcome(200, ['{"choices":[]}', '{"choices":[],"usage":{"completion_tokens":7}}',
                            '{"error":{"code":"service_unavailable"}}', "[DONE]"])
    assert outcome.done and outcome.completion_tokens() == 7
    assert outcome.errors == [{"code": "service_unavailable"}]
    assert not Outcome(200, ['{"choices":[]}']).done


def test_the_figures_become_a_table_and_reliability_md(tmp_path: Path) -> None:
    table = markdown(RESULTS)
    assert table.count("\n") == 7 and "72 refused with 429 before the first byte" in table
    path = tmp_path / "RELIABILITY.md"
    write_md(RESULTS, path)
    text = path.read_text()
    assert "make chaos" in text and table in text and "abc123" in text
