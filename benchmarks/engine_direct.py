"""The engine alone: vLLM's AsyncLLM in this process, no HTTP; the upper limit of the race, which
starts it as `python -m benchmarks.engine_direct --settings JSON` and sends it one run per line on
stdin, `{"concurrency", "sessions", "label"}`, each answered `{"result": ...}` on stdout (after
`{"ready": seconds}`). Requests are tokenized as the servers do, submitted in DELTA mode and timed as
the load generator times a stream. The engine core starts with `spawn`, hence the main guard."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
import uuid
from collections.abc import Callable
from typing import IO, Any

from benchmarks.loadgen import LoadConfig, RequestRecord, Result, Session, aggregate, request_body
from benchmarks.procs import answers


def start_engine(engine: dict[str, Any]) -> Any:
    from vllm import AsyncEngineArgs, AsyncLLMEngine

    return AsyncLLMEngine.from_engine_args(AsyncEngineArgs(**engine))  # the settings race.EngineAlone writes


class Driver:
    """Submits sessions to AsyncLLM with a fixed number in flight, and times every output."""

    def __init__(self, llm: Any, config: LoadConfig) -> None:
        from vllm import SamplingParams
        from vllm.sampling_params import RequestOutputKind

        self.llm, self.config, self.tokenizer = llm, config, llm.get_tokenizer()
        self.params = SamplingParams(max_tokens=config.output_tokens, ignore_eos=config.ignore_eos,
                                     temperature=1.0 if config.temperature is None else config.temperature,
                                     output_kind=RequestOutputKind.DELTA)

    def prompt(self, session: Session) -> Any:
        """What the server would submit for this session's first turn: token ids and text."""
        from vllm.inputs import tokens_input

        body = request_body(self.config, "engine", session, [], session.turns[0])
        if self.config.endpoint == "chat":
            text = self.tokenizer.apply_chat_template(body["messages"], tokenize=False, add_generation_prompt=True)
            return tokens_input(self.tokenizer.encode(text, add_special_tokens=False), prompt=text)
        return tokens_input(self.tokenizer.encode(body["prompt"]), prompt=body["prompt"])

    async def one(self, session: Session, record: RequestRecord, origin: float) -> None:
        started = time.perf_counter()
        record.start = started - origin
        first = last = None
        try:
            async for out in self.llm.generate(self.prompt(session), self.params, uuid.uuid4().hex):
                now = time.perf_counter()
                count = len(out.outputs[0].token_ids) if out.outputs else 0
                if count:
                    if first is None:
                        first = now
                    elif last is not None:
                        record.itl.append(now - last)
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
        pending, origin, end = iter(sessions), time.perf_counter(), 0.0

        async def worker() -> None:
            nonlocal end
            for session in pending:
                records.append(record := RequestRecord())
                await self.one(session, record, origin)
                end = time.perf_counter()

        await asyncio.gather(*(worker() for _ in range(max(1, concurrency))))
        return aggregate(records, (end or time.perf_counter()) - origin, label=label, concurrency=concurrency,
                         config={"target": "engine", "concurrency": concurrency})


async def serve(settings: dict[str, Any], commands: IO[str], answer: Callable[[dict[str, Any]], None],
                log: Callable[[str], None] = print) -> None:
    """Starts the engine of `settings["engine"]`, then runs on command until EOF or an empty line."""
    started = time.perf_counter()
    llm = start_engine(settings["engine"])
    driver = Driver(llm, LoadConfig(**settings.get("load", {})))
    try:
        answer({"ready": time.perf_counter() - started})
        while line := (await asyncio.to_thread(commands.readline)).strip():
            run = json.loads(line)
            result = await driver.run([Session(**s) for s in run["sessions"]], run["concurrency"], run.get("label", ""))
            log(f"engine {run.get('label', '')}: {result.output_throughput:.1f} output tok/s, "
                f"TTFT p50 {result.ttft.p50 * 1000:.1f} ms, TPOT p50 {result.tpot.p50 * 1000:.1f} ms")
            answer({"result": result.to_dict()})
    finally:
        llm.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Drive vLLM's AsyncLLM in-process (no HTTP), runs on command")
    p.add_argument("--settings", type=json.loads, required=True, help='{"engine": AsyncEngineArgs, "load": LoadConfig}')
    settings, answer = p.parse_args(argv).settings, answers()
    asyncio.run(serve(settings, sys.stdin, answer, log=lambda m: print(m, file=sys.stderr, flush=True)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
