"""The batch lane on a shared store, as replicas run it: records in Redis (a real redis-server),
contents on a shared volume or in an S3-compatible bucket (moto's S3 over HTTP). Replica R runs batches; replica V (`batches.enabled`
off) only answers. Both are gateways whose model is the session's gateway (a remote upstream: no
engine of their own, so they start in seconds). A batch uploaded and created on V runs on R; R is
killed (SIGKILL) mid-batch and started again, and resumes it; V answers its status and serves its
output throughout. Every custom_id is answered exactly once, each as the same request made
interactively at temperature 0, and another key sees none of it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest

from tests.integration.conftest import MODEL, gateway_process
from tests.integration.test_batches import kill, wait
from tests.redis_server import RedisServer

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("the batch lane's stores are the gateway's own")]
KEYS = ("sk-store-owner", "sk-store-other")
QUESTIONS = ["What is the capital of France?", "Name a colour.", "Say hello.", "Count to three.", "What is 2+2?"]
MODELS = """
models:
  - name: smol
    kind: remote
    url: {upstream}/v1
    upstream_model: smollm2-135m-instruct
"""


@pytest.fixture(scope="module")
def redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield server
    server.stop()


def store_env(backend: str, redis: RedisServer) -> dict[str, str]:
    if backend == "redis":
        return {"GATEWAY_STORE__BACKEND": "redis", "GATEWAY_STORE__REDIS_URL": redis.url}
    from tests.s3_server import shared

    s3 = shared()
    bucket = s3.bucket()
    return {"GATEWAY_STORE__BACKEND": "s3", "GATEWAY_STORE__REDIS_URL": redis.url,
            "GATEWAY_STORE__S3_ENDPOINT_URL": s3.url, "GATEWAY_STORE__REDIS_PREFIX": f"s3-{bucket}:",
            "GATEWAY_STORE__S3_BUCKET": bucket, "GATEWAY_STORE__S3_ACCESS_KEY_ID": "test",
            "GATEWAY_STORE__S3_SECRET_ACCESS_KEY": "test"}


def replica_env(folder: Path, store: dict[str, str], runs_batches: bool) -> dict[str, str]:
    """Contents on S3, or else in one folder all replicas share (a shared volume)."""
    if "GATEWAY_STORE__S3_BUCKET" not in store:
        folder = folder.parent / "shared"
    return {
        **store, "GATEWAY_MODELS_FILE": str(folder.parent / "models.yaml"), "GATEWAY_API_KEYS": json.dumps(list(KEYS)),
        "GATEWAY_CACHE__BACKEND": "off", "GATEWAY_WARMUP": "false", "GATEWAY_LOG_FORMAT": "json",
        "GATEWAY_FILES__DIR": str(folder / "spool"), "GATEWAY_BATCHES__DIR": str(folder / "batches"),
        "GATEWAY_BATCHES__ENABLED": str(runs_batches).lower(),
        "GATEWAY_BATCHES__POLL_S": "0.2", "GATEWAY_BATCHES__LEASE_S": "4",  # a killed replica's claim lapses soon
        "GATEWAY_BATCHES__MAX_IN_FLIGHT": "2",  # a slow batch
    }


def sdk(base: str, key: str = KEYS[0]) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0, timeout=120)


def line(custom_id: str, question: str) -> dict[str, Any]:
    body = {"model": "smol", "messages": [{"role": "user", "content": question}], "temperature": 0, "max_tokens": 32}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


@pytest.mark.parametrize("backend", ["redis", "s3"])
def test_a_batch_survives_its_replica_on_a_shared_store(
    backend: str, server: str, redis: RedisServer, tmp_path: Path,
) -> None:
    (tmp_path / "models.yaml").write_text(MODELS.format(upstream=server))
    store = store_env(backend, redis)
    runner_dirs = [tmp_path / "r1", tmp_path / "r2"]
    for folder in [*runner_dirs, tmp_path / "v", tmp_path / "shared"]:
        folder.mkdir()
    # questions of this backend's own: no answer from the upstream's cache of the other's run, so the kill comes mid-batch
    questions = [f"{question} ({backend})" for question in QUESTIONS]
    lines = [line(f"k{i}", questions[i % 5]) for i in range(24)]
    with gateway_process(tmp_path / "v", replica_env(tmp_path / "v", store, runs_batches=False)) as (viewer, _):
        owner = sdk(viewer)
        content = b"".join(json.dumps(item).encode() + b"\n" for item in lines)
        uploaded = owner.files.create(file=("requests.jsonl", content), purpose="batch")
        assert owner.files.content(uploaded.id).read() == content
        batch = owner.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                     completion_window="24h")
        with gateway_process(runner_dirs[0], replica_env(runner_dirs[0], store, runs_batches=True)) as (_, process):
            running = wait(owner, batch.id, lambda b: b.request_counts.completed >= 2, timeout=180)
            kill(process)  # mid-batch: no drain, its claim left to lapse
        assert running.status == "in_progress"
        assert wait(owner, batch.id, lambda b: True).request_counts.completed < len(lines)
        with gateway_process(runner_dirs[1], replica_env(runner_dirs[1], store, runs_batches=True)):
            done = wait(owner, batch.id, timeout=180)
        assert done.status == "completed"
        assert (done.request_counts.total, done.request_counts.completed, done.request_counts.failed) == (24, 24, 0)
        answers = [json.loads(raw) for raw in owner.files.content(done.output_file_id).read().splitlines()]
        assert sorted(a["custom_id"] for a in answers) == sorted(item["custom_id"] for item in lines)  # each once

        interactive = sdk(server)
        for question in questions:
            expected = interactive.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": question}], temperature=0, max_tokens=32,
            ).choices[0].message.content
            for answer in answers:
                if lines[int(answer["custom_id"][1:])]["body"]["messages"][0]["content"] == question:
                    assert answer["response"]["body"]["choices"][0]["message"]["content"] == expected

        other = sdk(viewer, KEYS[1])
        assert list(other.batches.list()) == []
        assert list(other.files.list()) == []
        with pytest.raises(openai.NotFoundError):
            other.files.content(done.output_file_id)
        with pytest.raises(openai.NotFoundError):
            other.batches.retrieve(batch.id)
