"""A drill (`make chaos`; an order of completion depends on the machine's speed, so it is not in
`make test`): priority on the real engine (#28 item 2): an engine "full" of low-priority work (max_num_seqs 2, a
KV cache that two long generations overflow) gets a high-priority request: vLLM's priority
scheduling puts it ahead of the low ones waiting, and preempts low ones (not it) when the cache runs
out, so it finishes first; the low ones are resumed and complete in full. What the gateway does
for it without timing: tests/unit/test_priority.py (classes admitted in order, the engine's priority)."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.integration.conftest import gateway_process
from tests.waits import until

pytestmark = pytest.mark.drill
MODEL = "smollm2-135m-instruct"
# 512 tokens of context; a KV cache of about 600 float32 tokens (46 KB each for SmolLM2-135M): two
# low generations of ~370 tokens cannot both finish without one being preempted
MODELS = f"""
models:
  - name: {MODEL}
    engine: {{enforce_eager: true, max_num_seqs: 2, max_model_len: 512, kv_cache_memory_bytes: 36000000}}
"""
KEYS = """
keys:
  batch: {key: sk-batch, priority: low}
  web: {key: sk-web, priority: high}
"""
LOW_TOKENS, HIGH_TOKENS = 340, 24


def engine_full(base: str) -> bool:
    """vLLM's gauges (the gateway's /metrics) show two requests running and one waiting in the engine."""
    families = {f.name: sum(s.value for s in f.samples) for f in text_string_to_metric_families(httpx.get(f"{base}/metrics").text)}
    return families.get("vllm:num_requests_running", 0) >= 2 and families.get("vllm:num_requests_waiting", 0) >= 1


@pytest.fixture(scope="module")
def gateway(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder: Path = tmp_path_factory.mktemp("priority")
    (folder / "models.yaml").write_text(MODELS)
    (folder / "keys.yaml").write_text(KEYS)
    env = {"GATEWAY_MODELS_FILE": str(folder / "models.yaml"), "GATEWAY_KEYS_FILE": str(folder / "keys.yaml"),
           "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_LOG_FORMAT": "json"}
    with gateway_process(folder, env) as (base, _):
        yield base


async def test_a_high_request_finishes_before_the_low_ones_that_fill_the_engine(gateway: str) -> None:
    done: list[str] = []
    answers: dict[str, openai.types.chat.ChatCompletion] = {}

    async def chat(name: str, key: str, tokens: int, topic: str) -> None:
        client = openai.AsyncOpenAI(base_url=f"{gateway}/v1", api_key=key, max_retries=0, timeout=600)
        answers[name] = await client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": f"Write a long story about {topic}."}],
            max_tokens=tokens, temperature=0, extra_body={"ignore_eos": True},
        )
        done.append(name)

    lows = [asyncio.create_task(chat(f"low-{i}", "sk-batch", LOW_TOKENS, topic))
            for i, topic in enumerate(["a ship", "a forest", "a city"])]
    await until(lambda: engine_full(gateway), 300, "the engine full: two low generating, one waiting in it")
    high = asyncio.create_task(chat("high", "sk-web", HIGH_TOKENS, "a cat"))
    await asyncio.gather(*lows, high)

    assert done[0] == "high", f"finished in the order {done}"
    assert answers["high"].service_tier == "priority"
    for name in ("low-0", "low-1", "low-2"):  # preempted and resumed, never failed or cut short
        answer = answers[name]
        assert answer.service_tier == "flex"
        assert answer.choices[0].finish_reason == "length"
        assert answer.usage is not None
        assert answer.usage.completion_tokens == LOW_TOKENS
