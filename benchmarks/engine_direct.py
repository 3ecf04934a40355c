"""The engine alone: vLLM's AsyncLLM in this process, no HTTP; the upper limit of the race.

    python -m benchmarks.engine_direct --plan plan.json [--answer-fd N]   # as race.py starts it

It answers `{"ready": seconds}`, then takes JSON lines on stdin, `{"sessions": "file"}` (answered
`{"warm": true}`) and `{"run": N}` (answered `{"key": ..., "result": ...}`) on descriptor N. Requests
are tokenized here, submitted in DELTA mode and timed as the load generator times a stream. The
engine core starts with `spawn`, hence the main guard.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from benchmarks.loadgen import LoadConfig, RequestRecord, Result, Session, aggregate, request_body
from benchmarks.procs import answer_on


def start_engine(engine: dict[str, Any]) -> Any:
    from vllm import AsyncEngineArgs, AsyncLLMEngine

    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**engine))  # the settings race.EngineAlone writes


class Driver:
    """Submits sessions to AsyncLLM with a fixed number in flight, and times every output."""

    def __init__(self, llm: Any, config: LoadConfig) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.llm = llm
        self.config = config
        self.tokenizer = llm.get_tokenizer()
        self.params = SamplingParams(
            max_tokens=config.output_tokens,
            temperature=1.0 if config.temperature is None else config.temperature,
            ignore_eos=config.ignore_eos,
            output_kind=RequestOutputKind.DELTA,
        )

    def prompt(self, session: Session) -> Any:
        """What the server would submit for this session's first turn: token ids and text."""
        body = request_body(self.config, "engine", session, [], session.turns[0])
        if self.config.endpoint == "chat":
            text = self.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
        else:
            text = body["prompt"]
            ids = self.tokenizer.encode(text)
        from vllm.inputs import tokens_input

        return tokens_input(ids, prompt=text)

    async def one(self, session: Session, record: RequestRecord, origin: float) -> None:
        started = time.perf_counter()
        record.start = started - origin
        first = last = None
        try:
            prompt = self.prompt(session)
            async for out in self.llm.generate(prompt, self.params, uuid.uuid4().hex):
                now = time.perf_counter()
                completion = out.outputs[0] if out.outputs else None
                count = len(completion.token_ids) if completion is not None else 0
                if count:
                    if first is None:
                        first = now
                    else:
                        record.itl.append(now - last)  # type: ignore[operator]
                    last = now
                    record.chunks += 1
                    record.output_tokens += count
                if out.finished:
                    record.input_tokens = len(out.prompt_token_ids or ())
                    record.cached_tokens = out.num_cached_tokens or 0
            record.e2e = time.perf_counter() - started
            record.ttft = (first - started) if first is not None else record.e2e
            record.usage_reported = record.ok = True
        except asyncio.CancelledError:
            record.cancelled = True
            raise
        except Exception as exc:
            record.e2e = time.perf_counter() - started
            record.error = f"{exc.__class__.__name__}: {exc}"[:300]

    async def run(self, sessions: list[Session], concurrency: int, label: str = "") -> Result:
        records: list[RequestRecord] = []
        pending = list(reversed(sessions))
        origin = time.perf_counter()
        ends: list[float] = []

        async def worker() -> None:
            while pending:
                session = pending.pop()
                record = RequestRecord()
                records.append(record)
                await self.one(session, record, origin)
                ends.append(time.perf_counter())

        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
        duration = (max(ends) if ends else time.perf_counter()) - origin
        return aggregate(records, duration, label=label, concurrency=concurrency,
                         config={"target": "engine", "concurrency": concurrency, "requests": len(sessions)})


def sessions_of(items: list[dict[str, Any]]) -> list[Session]:
    return [Session(**item) for item in items]


async def serve_plan(plan: dict[str, Any], commands: Any, answer: Any, log=print) -> None:
    """Runs on command, one JSON line each: {"sessions": path} reads the warm-up and runs from a
    plan file and warms up (answer {"warm": true}); {"run": N} runs runs[N]. EOF or an empty line ends."""
    started = time.perf_counter()
    llm = start_engine(plan["engine"])
    driver = Driver(llm, LoadConfig(**plan.get("load", {})))
    log(f"engine ready in {time.perf_counter() - started:.0f} s")
    try:
        answer({"ready": time.perf_counter() - started})
        runs: list[dict[str, Any]] = []
        while line := (await asyncio.to_thread(commands.readline)).strip():
            command = json.loads(line)
            if "sessions" in command:
                sessions = json.loads(await asyncio.to_thread(Path(command["sessions"]).read_text))
                for warm in sessions["warmup"]:
                    await driver.run(sessions_of(warm["sessions"]), warm["concurrency"], "warmup")
                runs = sessions["runs"]
                answer({"warm": True})
            else:
                run = runs[int(command["run"])]
                result = await driver.run(sessions_of(run["sessions"]), run["concurrency"], run.get("label", ""))
                log(f"engine {run.get('label', '')}: {result.output_throughput:.1f} output tok/s, "
                    f"TTFT p50 {result.ttft.p50 * 1000:.1f} ms, TPOT p50 {result.tpot.p50 * 1000:.1f} ms")
                answer({"key": run.get("key"), "result": result.to_dict()})
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Drive vLLM's AsyncLLM in-process with a race plan (no HTTP), on command")
    p.add_argument("--plan", type=Path, required=True)
    p.add_argument("--answer-fd", type=int, help="where the JSON lines go (default stdout)")
    args = p.parse_args(argv)
    plan = json.loads(args.plan.read_text())
    asyncio.run(serve_plan(plan, sys.stdin, answer_on(args.answer_fd), log=lambda m: print(m, file=sys.stderr, flush=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
