"""benchmarks.growth, its report and lag probe, and benchmarks.targets' judgement: behaviour only,
never timings (the sizes and bounds here are made-up documents)."""

from __future__ import annotations

import math
import time

import pytest
from starlette.applications import Starlette
from starlette.responses import PlainTextResponse
from starlette.routing import Route
from starlette.testclient import TestClient

from benchmarks import growth, targets
from benchmarks.echo_engine import PATH, LagProbe
from benchmarks.loadgen import RequestRecord, aggregate


def test_lag_probe_answers_its_path_and_passes_everything_else_on() -> None:
    inner = Starlette(routes=[Route("/x", lambda request: PlainTextResponse("inner"))])
    with TestClient(LagProbe(inner, interval_s=0.001)) as client:
        assert client.get("/x").text == "inner"
        time.sleep(0.05)  # time passing is the behaviour: the probe samples the loop's lag meanwhile
        first = client.get(PATH).json()
        again = client.get(PATH).json()
    assert first["samples"] > 0
    assert first["max_ms"] >= first["p99_ms"] >= first["p50_ms"] >= 0
    assert again["samples"] < first["samples"] or again["samples"] <= 5  # read and started afresh


def test_growth_defaults_are_small_and_full_is_the_issues_sizes() -> None:
    assert growth.FULL == {"lengths": [128, 256, 512, 1024, 2048, 4096], "streams": 1000, "cache_entries": 10000,
                           "soak_requests": 100000}
    assert all(growth.SMALL[k] <= growth.FULL[k] for k in ("streams", "cache_entries", "soak_requests"))
    args = growth.parser().parse_args(["--parts", "soak"])
    assert args.parts == ["soak"]
    assert args.soak_requests is None
    assert growth.SOAK_CACHE_ENTRIES == 10_000  # the gateway's default bound


def test_growth_report_renders_every_part() -> None:
    load = {"completed": 1, "failed": 0, "req_s": 1.0, "ttft_p50_ms": 1.0, "ttft_p99_ms": 2.0, "e2e_p50_ms": 1.0,
            "e2e_p99_ms": 2.0, "x_cache": {"HIT": 300}, "client_cpu_share": 0.1}
    lag = {"samples": 10, "interval_ms": 5.0, "p50_ms": 0.1, "p99_ms": 0.5, "max_ms": 1.0}
    document = {
        "started": "T", "command": "python -m benchmarks.growth",
        "prompt": [{"tokens": 128, "prompts": "random", "mean_input_tokens": 128.0, "gateway_cpu_ms_per_request": 0.5, **load}],
        "streams": {"streams": 1000, "rss_before_mib": 70.0, "rss_held_mib": 100.0, "kib_per_stream": 30.7, "loop_lag_idle": lag,
                    "loop_lag_held": lag, "health_p50_ms": 1.0, "health_p99_ms": 2.0, "health_max_ms": 3.0, "load": load},
        "cache": {"entries": 10000, "answer_tokens": 64, "rss_before_mib": 60.0, "rss_after_mib": 90.0, "bytes_per_entry": 3145.0,
                  "fill": load, "hit_nearly_empty": load, "hit_full": load},
        "soak": {"requests": 20000, "failed": 0, "points": [{"requests": 0, "rss_mib": 60.0}, {"requests": 20000, "rss_mib": 61.0}],
                 "cache_bound_entries": 10000, "rss_at_bound_mib": None, "rss_end_mib": 61.0, "growth_after_bound_mib": None},
    }
    text = growth.markdown(document)
    assert "| 128 | random | 128.0 |" in text
    assert "| 1000 | 70.0 | 100.0 | 30.7 |" in text
    assert "| 10000 | 64 | 60.0 | 90.0 | 3145 |" in text
    assert "was not reached" in text
    document["soak"].update(rss_at_bound_mib=60.5, growth_after_bound_mib=0.5)
    assert "growth after the bound: +0.5 MiB" in growth.markdown(document)


def _result(records: list[RequestRecord]) -> object:
    return aggregate(records, 10.0, keep_records=True)


def test_targets_ttft_p99_counts_refusals_and_long_waits_as_misses() -> None:
    served = [RequestRecord(ok=True, ttft=0.1, e2e=1.0) for _ in range(97)]
    assert targets.ttft_p99_ms(_result(served)) == pytest.approx(100.0)
    cut_short = RequestRecord(cancelled=True, e2e=0.2)  # cut off before the bound: unknown, left out
    assert targets.ttft_p99_ms(_result([*served, cut_short])) == pytest.approx(100.0)
    refused = RequestRecord(error="HTTP 429: overloaded", e2e=0.01)
    waited = RequestRecord(cancelled=True, e2e=3.0)  # no first token after 3 s: a miss
    started = RequestRecord(cancelled=True, ttft=0.3, e2e=3.0)  # its first token came: counted as such
    p99 = targets.ttft_p99_ms(_result([*served, refused, waited, started]))
    assert math.isinf(p99)


def test_targets_verdicts_say_met_or_missed_and_by_how_much() -> None:
    main_run = {"rate": 55.0, "sustained_req_s": 2.0, "ttft_p99_ms": 5000.0}
    memory = {"judged": "the gateway's processes", "judged_share": 0.2}
    sustained, ttft, mem = targets.verdicts(main_run, memory)
    assert not sustained["met"]
    assert sustained["factor"] == pytest.approx(25.0)
    assert not ttft["met"]
    assert ttft["factor"] == pytest.approx(10.0)
    assert mem["met"]
    assert mem["factor"] == pytest.approx(0.25)
    fine = targets.verdicts({"rate": 55.0, "sustained_req_s": 54.0, "ttft_p99_ms": 120.0}, memory)
    assert all(v["met"] for v in fine)
    text = targets.report({"verdicts": [sustained, ttft, mem], "memory": {**memory, "gateway_peak": 0.2, "samples": 3},
                           "capacity": [{"rate": 27.5, "ttft_p99_ms": 9e9, "failed": 3, "sustained_req_s": 2.0, "duration_s": 20.0},
                                        {"rate": 1.7, "ttft_p99_ms": 300.0, "failed": 0, "sustained_req_s": 1.7, "duration_s": 20.0}]})
    assert "MISSED by 25.0x" in text
    assert "MISSED by 10.0x" in text
    assert "| met |" in text
    assert "held at 1.7 req/s offered (TTFT p99 300 ms over 20 s)" in text
    assert f"{50 / 1.7:.1f}x below" in text
