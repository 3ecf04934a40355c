"""Run.collect: every output taken, then the engine request closed (aborted when it ends early)."""

from __future__ import annotations

import asyncio

import pytest

from engine.types import GenerationOutput, GenerationRequest
from gateway.apis.completions import completions_serving
from gateway.protocol.openai import CompletionRequest
from gateway.serving.generation import Run
from tests.fakes import FakeEngine


def _generation(engine: FakeEngine, max_tokens: int = 3, n: int = 1) -> GenerationRequest:
    request = CompletionRequest.model_validate({"model": "fake-model", "prompt": "a b", "max_tokens": max_tokens, "n": n})
    return completions_serving.prepare(request, engine, None).generations[0]


async def _collected(engine: FakeEngine, generation: GenerationRequest, seen: list[GenerationOutput] | None) -> Run:
    run = await Run(engine, generation).start()
    return await run.collect(seen.append if seen is not None else None)


async def _streamed(engine: FakeEngine, generation: GenerationRequest) -> tuple[Run, list[GenerationOutput]]:
    run = await Run(engine, generation).start()
    return run, [output async for output in run.outputs()]


@pytest.mark.parametrize("with_each", [True, False])
def test_collect_takes_what_outputs_gives(with_each: bool) -> None:
    engine = FakeEngine()
    generation = _generation(engine, n=2)
    seen: list[GenerationOutput] = []
    run = asyncio.run(_collected(engine, generation, seen if with_each else None))
    other, outputs = asyncio.run(_streamed(engine, generation))
    assert [c.text for c in run.choices] == [c.text for c in other.choices] == [["the", " quick", " brown"]] * 2
    assert [c.tokens for c in run.choices] == [3, 3]
    assert run.completion_tokens() == 6
    assert run.prompt_tokens == other.prompt_tokens == 2
    assert [c.finish_reason for c in run.choices] == ["length", "length"]
    assert seen == (outputs if with_each else [])
    assert engine.finished == [generation.request_id] * 2
    assert not engine.running


def test_collect_closes_the_engine_request_when_a_hand_off_fails() -> None:
    engine = FakeEngine()
    generation = _generation(engine, max_tokens=5)

    def each(output: GenerationOutput) -> None:
        if output.choices[0].text == " quick":
            raise ValueError("no")

    async def go() -> Run:
        run = await Run(engine, generation).start()
        with pytest.raises(ValueError, match="no"):
            await run.collect(each)
        assert engine.aborted == [generation.request_id]
        assert not engine.running
        return run

    run = asyncio.run(go())
    assert engine.aborted == [generation.request_id]
    assert not engine.running
    assert run.completion_tokens() == 2  # what it took before the failure


def test_collect_passes_on_an_engine_failure_and_closes() -> None:
    engine = FakeEngine()
    engine.fail_after = 1
    generation = _generation(engine, max_tokens=4)
    with pytest.raises(RuntimeError, match="fake engine failure"):
        asyncio.run(_collected(engine, generation, None))
    assert not engine.running
    assert engine.finished == []
