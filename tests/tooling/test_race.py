"""The race without servers: its arithmetic (medians, paired ratios, targets), its commands, the
engine alone on a stand-in for AsyncLLM, RESULTS.md's hand-written part; and no benchmark module
imports vLLM. Behaviour only, never timings."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks import loadgen, race, race_report
from benchmarks.loadgen import LoadConfig, RequestRecord

REPO = Path(__file__).resolve().parents[2]


# ---------------------------------------------------------------------------------------------
# the race's arithmetic (no servers)


def _run(target: str, repeat: int, level: int, tok_s: float, ttft_ms: float) -> dict:
    metrics = {name: None for name in race_report.METRICS}
    metrics.update(output_tok_s=tok_s, ttft_p50_ms=ttft_ms, ttft_p99_ms=2 * ttft_ms, tpot_p50_ms=10.0,
                   mean_output_tokens=64.0, failed=0)
    return {"target": target, "repeat": repeat, "concurrency": level, "metrics": metrics}


def test_race_summary_medians_ratios_and_targets() -> None:
    runs = []
    for r, (g, v, e) in enumerate([(100, 100, 100), (110, 100, 120), (90, 120, 100)]):
        runs += [_run("gateway", r, 4, g, 50), _run("vllm", r, 4, v, 60), _run("engine", r, 4, e, 40)]
    (row,) = race_report.summarize(runs, [4])
    assert row["medians"]["gateway"]["output_tok_s"] == 100
    assert row["medians"]["vllm"]["output_tok_s"] == 100
    # against vLLM: median of the paired ratios 1.0, 1.1, 0.75
    assert row["ratios"]["vllm"]["output_tok_s"] == pytest.approx(1.0)
    # against the engine, also paired: median of 1.0, 110/120, 0.9
    assert row["ratios"]["engine"]["output_tok_s"] == pytest.approx(110 / 120)
    assert row["ratios"]["vllm"]["ttft_p50_ms"] == pytest.approx(50 / 60)
    assert row["targets"]["output_tok_s vs vllm"]["met"] is True
    assert row["targets"]["ttft_p99_ms vs vllm"]["met"] is True
    document = {"settings": {"repeats": 3}, "summary": [row], "notes": ["a note"]}
    table = race_report.markdown(document)
    assert "| 4 | gateway | 100.0 |" in table
    assert "1.000 ✓" in table
    assert "- a note" in table


def test_race_metrics_of_a_result() -> None:
    result = loadgen.aggregate([RequestRecord(ok=True, ttft=0.1, e2e=0.5, output_tokens=5, chunks=5, itl=[0.1] * 4)], 1.0)
    metrics = loadgen.metrics_of(result.to_dict())
    assert metrics["output_tok_s"] == pytest.approx(5.0)
    assert metrics["ttft_p50_ms"] == pytest.approx(100.0)
    assert metrics["tpot_p50_ms"] == pytest.approx(100.0)


def test_race_commands_use_the_same_engine_settings() -> None:
    args = race.parser().parse_args(["--eager"])
    args.model = "/models/m"
    gateway = race.gateway_command(args, eager=True)
    vllm = race.vllm_command(args, eager=True)
    for command in (gateway, vllm):
        for flag, value in (("--model", "/models/m"), ("--dtype", "float32"), ("--max-model-len", "2048"),
                            ("--kv-cache-memory-bytes", str(2 * 1024**3)), ("--served-model-name", "smollm2-135m-instruct")):
            assert command[command.index(flag) + 1] == value
        assert "--enforce-eager" in command
    assert vllm[2] == "vllm.entrypoints.openai.api_server"
    assert gateway[2:4] == ["gateway", "serve"]
    assert "--enforce-eager" not in race.gateway_command(args, eager=False)


def test_benchmark_modules_do_not_import_vllm() -> None:
    code = ("import sys, benchmarks.loadgen, benchmarks.echo_engine, benchmarks.race, benchmarks.engine_direct, "
            "benchmarks.instant_endpoint, benchmarks.vllm_bench, benchmarks.growth, "
            "benchmarks.targets; "
            "assert 'vllm' not in sys.modules and 'torch' not in sys.modules, 'imported vllm'")
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, timeout=60)


# ---------------------------------------------------------------------------------------------
# the engine alone, on command (a stand-in for AsyncLLM: benchmarks.engine_direct imports vllm lazily)


class _Tokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [len(word) for word in text.split()]

    def apply_chat_template(self, messages: list[dict], tokenize: bool, add_generation_prompt: bool) -> str:
        return " ".join(m["content"] for m in messages)


class _Out:
    def __init__(self, token_ids: list[int], finished: bool, prompt_ids: list[int]) -> None:
        self.outputs = [type("Completion", (), {"token_ids": token_ids})()]
        self.finished, self.prompt_token_ids, self.num_cached_tokens = finished, prompt_ids, 0


class _FakeLLM:
    """Answers each request with `max_tokens` outputs of one token each, as DELTA mode would."""

    def __init__(self) -> None:
        self.requests: list[tuple[list[int], int]] = []
        self.shut = False

    def get_tokenizer(self) -> _Tokenizer:
        return _Tokenizer()

    async def generate(self, prompt, params, request_id):
        ids = prompt["prompt_token_ids"] if isinstance(prompt, dict) else prompt.prompt_token_ids
        self.requests.append((ids, params.max_tokens))
        for i in range(params.max_tokens):
            await asyncio.sleep(0)
            yield _Out([7], i == params.max_tokens - 1, ids)

    def shutdown(self) -> None:
        self.shut = True


async def test_engine_alone_runs_on_command(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("vllm")  # SamplingParams comes from vLLM even with a stand-in engine
    from benchmarks import engine_direct

    llm = _FakeLLM()
    monkeypatch.setattr(engine_direct, "start_engine", lambda settings: llm)
    config = LoadConfig(base_url="http://engine.invalid/v1", endpoint="completions", output_tokens=5, ignore_eos=True)
    sessions = [dataclasses.asdict(s) for s in await loadgen.build_sessions(config, 3, None, seed=1)]
    commands = iter([json.dumps({"concurrency": 1, "label": "r0 c1", "sessions": sessions[:2]}),
                     json.dumps({"concurrency": 2, "label": "r0 c2", "sessions": sessions}), ""])
    stdin = type("Lines", (), {"readline": lambda self: next(commands) + "\n"})()
    answers: list[dict] = []
    await engine_direct.serve({"engine": {}, "load": config.to_dict()}, stdin, answers.append, log=lambda m: None)

    assert "ready" in answers[0]
    assert [a["result"]["concurrency"] for a in answers[1:]] == [1, 2]
    assert answers[1]["result"]["completed"] == 2
    assert answers[2]["result"]["completed"] == 3
    assert answers[2]["result"]["total_output_tokens"] == 15
    assert answers[2]["result"]["failed"] == 0
    assert len(llm.requests) == 2 + 3
    assert all(n == 5 for _, n in llm.requests)
    assert llm.shut


def test_results_md_keeps_the_hand_written_part(tmp_path: Path) -> None:
    results = tmp_path / "RESULTS.md"
    assert race_report.kept_part(results) == ""
    results.write_text(f"# old table\n| 1 | 2 |\n{race_report.KEEP_MARKER}\n## Profile\nby hand\n")
    kept = race_report.kept_part(results)
    assert kept.startswith(f"\n{race_report.KEEP_MARKER}")
    assert "by hand" in kept
    assert "old table" not in kept


# ---------------------------------------------------------------------------------------------
# A/A: every ratio beside its noise floor


def test_race_summary_keeps_the_spread_of_the_aa_twin() -> None:
    runs = []
    for r, (g, aa, v) in enumerate([(100, 98, 100), (104, 100, 100), (96, 101, 120)]):
        runs += [_run("gateway", r, 4, g, 50), _run("gateway-aa", r, 4, aa, 50), _run("vllm", r, 4, v, 60)]
    (row,) = race_report.summarize(runs, [4])
    low, high = row["spread"]["gateway-aa"]["output_tok_s"]
    assert (low, high) == (pytest.approx(96 / 101), pytest.approx(104 / 100))
    assert row["ratios"]["gateway-aa"]["output_tok_s"] == pytest.approx(100 / 98)
    # gateway ÷ vllm: median of 1.0, 1.04, 0.8 = 1.0, inside the A/A range: not told apart from noise
    assert race_report.within(row["ratios"]["vllm"]["output_tok_s"], (low, high)) is True
    assert race_report.within(0.5, (low, high)) is False
    assert race_report.within(None, (low, high)) is None
    # the band is symmetric about 1.0: an A/A of 0.8 says 1.2 could come from noise as easily
    assert race_report.within(1.2, (0.8, 0.8)) is True
    assert race_report.within(0.7, (0.8, 0.8)) is False
    table = race_report.markdown({"settings": {"repeats": 3}, "summary": [row], "notes": []})
    assert "| 4 | gateway-aa |" in table
    assert f"| 4 | output_tok_s | 1.000 ✓ ≈ | - | {100 / 98:.3f} [{96 / 101:.3f}, {104 / 100:.3f}] |" in table


def _echo_run(target: str, scenario: str, repeat: int, level: int, req_s: float) -> dict:
    metrics = {name: None for name in race_report.METRICS} | {"req_s": req_s, "output_tok_s": req_s * 64, "failed": 0}
    metrics["client_headroom"] = 30000 / req_s  # the client's ceiling, 30k req/s, ÷ this run
    return {"target": target, "scenario": scenario, "repeat": repeat, "concurrency": level, "metrics": metrics}


def test_echo_part_ratios_to_the_bare_stack_and_its_table() -> None:
    runs = []
    for r in range(2):
        runs += [_echo_run("echo", "non-stream", r, 16, 3000), _echo_run("echo-aa", "non-stream", r, 16, 3000 + 100 * r),
                 _echo_run("bare", "non-stream", r, 16, 10000)]
        runs += [_echo_run("echo", "stream", r, 16, 400), _echo_run("echo-aa", "stream", r, 16, 400),
                 _echo_run("bare", "stream", r, 16, 500)]
    document = {"echo_runs": runs, "notes": []}
    document["echo_summary"] = race_report.echo_summary(document)
    (plain,) = document["echo_summary"]["non-stream"]
    assert plain["ratios"]["bare"]["req_s"] == pytest.approx(0.3)
    (stream,) = document["echo_summary"]["stream"]
    assert stream["ratios"]["bare"]["output_tok_s"] == pytest.approx(0.8)
    table = race_report.markdown(document)
    assert "| non-stream | 16 | req/s | 3000.0 | 3050.0 | 10000.0 | 0.300 ✗ |" in table
    assert "| stream | 16 | chunks/s | 25600.0 | 25600.0 | 32000.0 | 0.800 ✓ |" in table
    assert "| 0 | 10.0 / 3.0 |" in table  # failed, then the client's headroom over echo and over bare
    notes: list[str] = []
    race_report.target_notes(notes, plain, None, "echo non-stream ")
    assert notes == ["echo non-stream c=16: the client's ceiling was only 3.0x bare's rate (wanted 5x): "
                     "the client may be part of that measurement"]


def test_race_parser_offers_both_clients_and_the_aa_switch() -> None:
    args = race.parser().parse_args(["--client", "vllm", "--no-aa", "--parts", "gateway", "echo"])
    assert args.client == "vllm"
    assert args.aa is False
    assert args.parts == ["gateway", "echo"]
    defaults = race.parser().parse_args([])
    assert defaults.client == "ours"
    assert defaults.aa is True
    assert defaults.ceiling_duration > 0
    assert "echo" in defaults.parts
    assert defaults.echo_scenarios == ["non-stream", "stream", "cache hit"]


def test_echo_runs_measure_the_clients_ceiling() -> None:
    args = race.parser().parse_args(["--parts", "echo", "--ceiling-duration", "1.5"])
    config = race.scenario_config(args, "stream", "http://127.0.0.1:1", 16, 7, "echo stream r0 c16")
    assert config.ceiling_s == 1.5
    assert config.stream
    assert config.concurrency == 16


# ---------------------------------------------------------------------------------------------
# vLLM's client (vllm bench serve, driven from Python)


def test_vllm_bench_result_into_the_race_metrics() -> None:
    from benchmarks import vllm_bench

    result = {"completed": 10, "failed": 1, "total_output_tokens": 640, "output_throughput": 64.0, "request_throughput": 1.0,
              "median_ttft_ms": 100.0, "p99_ttft_ms": 200.0, "median_tpot_ms": 20.0, "p99_itl_ms": 40.0, "median_e2el_ms": 1400.0}
    metrics = vllm_bench.metrics_of(result)
    assert metrics == {"output_tok_s": 64.0, "req_s": 1.0, "ttft_p50_ms": 100.0, "ttft_p99_ms": 200.0, "tpot_p50_ms": 20.0,
                       "itl_p99_ms": 40.0, "e2e_p50_ms": 1400.0, "mean_output_tokens": 64.0, "failed": 1}
    assert set(metrics) <= set(loadgen.metrics_of({})) | {"failed"}


def test_vllm_bench_argv_is_what_vllms_own_parser_takes() -> None:
    pytest.importorskip("vllm")
    from vllm.benchmarks.serve import add_cli_args
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from benchmarks import vllm_bench

    argv = vllm_bench.bench_argv(base_url="http://127.0.0.1:8000/v1", model="m", tokenizer="/models/m", endpoint="completions",
                                 concurrency=16, num_prompts=64, input_len=128, output_len=64, seed=7)
    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    args = parser.parse_args(argv)
    assert (args.base_url, args.endpoint, args.backend) == ("http://127.0.0.1:8000", "/v1/completions", "openai")
    assert (args.max_concurrency, args.num_prompts, args.random_input_len, args.random_output_len) == (16, 64, 128, 64)
    assert args.ignore_eos
    assert args.temperature == 0
    assert args.seed == 7
    assert args.dataset_name == "random"
    chat = parser.parse_args(vllm_bench.bench_argv(base_url="http://h:1", model="m", tokenizer="t", endpoint="chat",
                                                   concurrency=1, num_prompts=1, input_len=1, output_len=1, seed=0))
    assert (chat.backend, chat.endpoint) == ("openai-chat", "/v1/chat/completions")


async def test_a_commanded_child_answers_on_its_stdout_and_logs_its_prints(tmp_path: Path) -> None:
    from benchmarks.procs import Proc

    child = ("from benchmarks.procs import answers\nimport json, sys\nanswer = answers()\nprint('chatter')\n"
             "for line in sys.stdin:\n    answer({'twice': 2 * json.loads(line)['n']})\n")
    proc = Proc("child", [sys.executable, "-c", child], {}, tmp_path / "child.log", commanded=True)
    proc.start()
    try:
        proc.send({"n": 21})
        assert await proc.answer(30) == {"twice": 42}
    finally:
        proc.stop()
    assert "chatter" in (tmp_path / "child.log").read_text()
