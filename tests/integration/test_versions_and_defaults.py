"""Model versions and sampling defaults on the real engine, through the openai SDK: one more gateway
whose models file declares three versions of `smol` (1.0.0 embedded, on a copy of the default model
with a generation_config.json of its own; 1.1.0 and the pre-release 2.0.0-rc.1 remote, the session's
gateway behind them), and a real start refused for a setting the CPU cannot use."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from engine.models import default_model_dir
from tests.integration.conftest import MODEL, REPO, gateway_process
from tests.waits import until_sync

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("versions and per-model defaults are the gateway's")]
STORY = [{"role": "user", "content": "Write a long story about a dragon who learns to fly."}]
# what the model's authors could ship: greedy (top_k 1) and 7 new tokens at most
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2, "do_sample": True, "top_k": 1,
                     "max_new_tokens": 7}
MODELS = """
models:
  - name: smol
    version: 1.0.0
    engine: {{model: {model}, enforce_eager: true}}
    defaults: {{max_tokens: 9}}              # over the generation config's 7
  - name: smol
    version: 1.1.0
    kind: remote
    url: {upstream}/v1
    upstream_model: {upstream_model}
    defaults: {{max_tokens: 5}}              # added to what goes upstream
  - name: smol
    version: 2.0.0-rc.1
    kind: remote
    url: {upstream}/v1
    upstream_model: {upstream_model}
"""


def model_copy(folder: Path) -> Path:
    """The default model's files (linked, not copied) with a generation_config.json of our own."""
    source, target = default_model_dir(), folder / "smol-tuned"
    target.mkdir()
    for item in source.iterdir():
        if item.name != "generation_config.json":
            (target / item.name).symlink_to(item)
    (target / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return target


@pytest.fixture(scope="module")
def versioned(server: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    folder = tmp_path_factory.mktemp("versioned")
    models = folder / "models.yaml"
    models.write_text(MODELS.format(model=model_copy(folder), upstream=server, upstream_model=MODEL))
    env = {"GATEWAY_MODELS_FILE": str(models), "GATEWAY_WARMUP": "false", "GATEWAY_LOG_FORMAT": "json",
           "GATEWAY_CACHE__BACKEND": "off"}
    with gateway_process(folder, env) as (base, _):
        yield base, folder / "gateway.log"


@pytest.fixture
def client(versioned: tuple[str, Path]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{versioned[0]}/v1", api_key="unused", max_retries=0, timeout=300)


def access_line(log: Path, request_id: str) -> dict:
    """The request's access line, written just after its last byte was sent (so it may lag a little)."""
    def found() -> list[dict]:
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        return [line for line in lines if line.get("event") == "request" and line.get("request_id") == request_id]

    lines = until_sync(found, 30, f"the access line of {request_id}", step_s=0.2)
    assert len(lines) == 1, f"no single access line for {request_id}"
    return lines[0]


def test_models_lists_every_version(client: openai.OpenAI) -> None:
    ids = {model.id for model in client.models.list().data}
    assert ids == {"smol@1.0.0", "smol@1.1.0", "smol@2.0.0-rc.1", "smol"}


@pytest.mark.parametrize(
    ("asked", "served"),
    [("smol", "smol@1.1.0"), ("smol@1", "smol@1.1.0"), ("smol@1.0", "smol@1.0.0"), ("smol@1.0.0", "smol@1.0.0"),
     ("smol@2.0.0-rc.1", "smol@2.0.0-rc.1")],
)
def test_versions_as_asked_with_the_served_version_in_the_header_and_log(
    client: openai.OpenAI, versioned: tuple[str, Path], asked: str, served: str
) -> None:
    raw = client.chat.completions.with_raw_response.create(
        model=asked, messages=STORY, max_tokens=2, extra_headers={"X-Request-ID": f"version-{asked}"})
    assert raw.headers["x-model-version"] == served
    assert raw.headers["x-served-model"] == served
    assert raw.parse().choices[0].message.content
    line = access_line(versioned[1], f"version-{asked}")
    assert line["version"] == served
    assert line["model"] == asked


@pytest.mark.parametrize("asked", ["smol@2", "smol@3.1", "smol@1.0.1", "smol@stable"])
def test_unsatisfiable_version_is_404_naming_the_versions(client: openai.OpenAI, asked: str) -> None:
    with pytest.raises(openai.NotFoundError) as refused:
        client.chat.completions.create(model=asked, messages=STORY, max_tokens=2)
    error = refused.value.body
    assert error["code"] == "model_not_found"
    assert "smol has versions 1.0.0, 1.1.0, 2.0.0-rc.1" in error["message"]


def test_generation_config_and_models_file_defaults_on_the_engine(client: openai.OpenAI) -> None:
    silent = client.chat.completions.create(model="smol@1.0.0", messages=STORY, n=3)
    assert silent.usage.completion_tokens == 3 * 9  # the models file's max_tokens, over the config's 7
    texts = {choice.message.content for choice in silent.choices}
    greedy = client.chat.completions.create(model="smol@1.0.0", messages=STORY, temperature=0, max_tokens=9)
    assert texts == {greedy.choices[0].message.content}  # top_k 1, from generation_config.json
    said = client.chat.completions.create(model="smol@1.0.0", messages=STORY, n=4, max_tokens=12, temperature=2.0,
                                          extra_body={"top_k": -1})
    assert said.usage.completion_tokens == 4 * 12
    assert len({choice.message.content for choice in said.choices}) > 1  # the request's sampling wins


def test_completions_keep_sixteen_tokens_with_the_model_sampling(client: openai.OpenAI) -> None:
    first, second = (client.completions.create(model="smol@1.0", prompt="Once upon a time", extra_body={"ignore_eos": True})
                     for _ in range(2))
    assert first.usage.completion_tokens == 16  # OpenAI's and vLLM's completions default, not the chat budget
    assert first.choices[0].text == second.choices[0].text  # greedy: top_k 1


def test_native_routes_take_the_model_defaults(versioned: tuple[str, Path]) -> None:
    base = versioned[0]
    chat = httpx.post(f"{base}/chat", json={"model": "smol@1.0.0", "messages": STORY}, timeout=120).json()
    greedy = httpx.post(f"{base}/chat", json={"model": "smol@1.0.0", "messages": STORY, "temperature": 0,
                                               "max_tokens": 9}, timeout=120).json()
    assert chat["usage"]["completion_tokens"] == 9
    assert chat["output"] == greedy["output"]
    streamed = httpx.post(f"{base}/chat", json={"model": "smol@1.0.0", "messages": STORY, "stream": True}, timeout=120)
    events = [line[6:] for line in streamed.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    assert "".join(json.loads(e)["output"] for e in events[:-1]) == greedy["output"]
    generated = [httpx.post(f"{base}/generate", json={"model": "smol@1.0.0", "prompt": "The dragon", "max_tokens": 8},
                            timeout=120).json()["output"] for _ in range(2)]
    assert generated[0] == generated[1]
    assert generated[0]


def test_remote_version_gets_its_defaults_upstream(client: openai.OpenAI) -> None:
    answer = client.chat.completions.create(model="smol@1.1.0", messages=STORY)
    assert answer.usage.completion_tokens == 5
    assert client.chat.completions.create(model="smol@1.1.0", messages=STORY, max_tokens=3).usage.completion_tokens == 3


def test_the_default_model_has_no_sampling_defaults(server: str, server_log: Path) -> None:
    """SmolLM2's generation_config.json (as its authors ship it, and as engine.models writes it) sets no
    sampling parameter: the session's gateway reports none, and OpenAI's defaults apply."""
    reported = [json.loads(line) for line in server_log.read_text().splitlines()
                if line.startswith("{") and '"sampling_defaults"' in line]
    assert [{k: v for k, v in line.items() if k not in ("timestamp", "level")} for line in reported] == [
        {"event": "sampling_defaults", "model": MODEL}]


def test_a_setting_the_cpu_cannot_use_is_refused_at_start(tmp_path: Path) -> None:
    env = {**os.environ, "GATEWAY_ENGINE__QUANTIZATION": "fp8", "GATEWAY_ENGINE__DTYPE": "bfloat16"}
    result = subprocess.run([sys.executable, "-m", "gateway", "serve", "--port", "0"],
                            capture_output=True, text=True, env=env, cwd=REPO, timeout=300)
    assert result.returncode == 2
    assert "configuration error: model 'smollm2-135m-instruct': quantization (GATEWAY_ENGINE__QUANTIZATION): " \
           "'fp8' does not run on the CPU" in result.stderr
