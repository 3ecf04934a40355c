"""The command line, generated from the Settings classes: the flags it always had keep their meaning,
every setting but the secrets has a flag that sets exactly that setting, flags win over the
environment (nested settings merged), and a bad flag exits with status 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gateway.server import cli
from gateway.server.cli import overrides, parser, settings_from
from gateway.server.options import options
from gateway.settings import Settings


def settings(*flags: str) -> Settings:
    return settings_from(parser().parse_args(["serve", *flags]))


# the flags of the hand-kept parser this one replaced: same names, same meaning
@pytest.mark.parametrize(("flags", "read", "expected"), [
    (["--host", "0.0.0.0"], lambda s: s.host, "0.0.0.0"),
    (["--port", "8001"], lambda s: s.port, 8001),
    (["--log-level", "debug"], lambda s: s.log_level, "debug"),
    (["--log-format", "json"], lambda s: s.log_format, "json"),
    (["--model", "/models/m"], lambda s: s.engine.model, "/models/m"),
    (["--served-model-name", "x"], lambda s: s.engine.served_model_name, "x"),
    (["--embedding-model", "e"], lambda s: s.embedding_model, "e"),
    (["--keys-file", "/k.yaml"], lambda s: s.keys_file, Path("/k.yaml")),
    (["--max-model-len", "512"], lambda s: s.engine.max_model_len, 512),
    (["--dtype", "bfloat16"], lambda s: s.engine.dtype, "bfloat16"),
    (["--gpu-memory-utilization", "0.5"], lambda s: s.engine.gpu_memory_utilization, 0.5),
    (["--kv-cache-memory-bytes", "1024"], lambda s: s.engine.kv_cache_memory_bytes, 1024),
    (["--enforce-eager"], lambda s: s.engine.enforce_eager, True),
    (["--tensor-parallel-size", "2"], lambda s: s.engine.tensor_parallel_size, 2),
    (["--max-num-seqs", "8"], lambda s: s.engine.max_num_seqs, 8),
    (["--engine-arg", "a=4", "--engine-arg", "b=x", "--engine-arg", 'c={"d": 1}'],
     lambda s: s.engine.engine_args, {"a": 4, "b": "x", "c": {"d": 1}}),
    (["--tls-cert-file", "/c.pem", "--tls-key-file", "/k.pem"], lambda s: (s.tls.cert_file, s.tls.key_file),
     (Path("/c.pem"), Path("/k.pem"))),
    (["--tls-cert-file", "/c.pem", "--tls-ca-file", "/ca.pem", "--tls-client-auth", "optional"],
     lambda s: (s.tls.ca_file, s.tls.client_auth), (Path("/ca.pem"), "optional")),
    (["--tls-cert-file", "/c.pem", "--tls-min-version", "TLSv1.3"], lambda s: s.tls.min_version, "TLSv1.3"),
])
def test_the_flags_it_always_had(flags: list[str], read: Any, expected: Any) -> None:
    assert read(settings(*flags)) == expected


def test_no_enforce_eager_turns_off_what_the_environment_turned_on(monkeypatch) -> None:
    monkeypatch.setenv("GATEWAY_ENGINE__ENFORCE_EAGER", "true")
    assert settings().engine.enforce_eager is True
    assert settings("--no-enforce-eager").engine.enforce_eager is False


def sample(option: Any) -> tuple[list[str], Any]:
    """A flag's arguments and the value they set, by the setting's type."""
    assert option.flag is not None
    if option.flag == "--engine-arg":
        return [option.flag, "k=1"], {"k": 1}
    if option.is_bool:
        return [option.flag], True
    if option.choices is not None:
        return [option.flag, str(option.choices[-1])], option.choices[-1]
    if option.is_json:
        return [option.flag, '{"low": 0.25}'], {"low": 0.25}
    if option.annotation in (int, float):
        return [option.flag, "3"], option.annotation(3)
    return [option.flag, "/some/thing"], "/some/thing"


@pytest.mark.parametrize("option", [o for o in options() if o.flag], ids=lambda o: o.flag)
def test_every_flag_sets_its_setting_and_only_that(option: Any) -> None:
    flags, value = sample(option)
    expected: dict[str, Any] = {option.path[-1]: value}
    for key in reversed(option.group):
        expected = {key: expected}
    assert overrides(parser().parse_args(["serve", *flags])) == expected


def test_flags_are_unique_and_secrets_have_none() -> None:
    flags = [o.flag for o in options() if o.flag]
    assert len(flags) == len(set(flags))
    assert {o.name for o in options() if o.flag is None} == {
        "api_keys", "admin_keys", "key_id_secret", "tls.key_password", "store.s3_access_key_id",
        "store.s3_secret_access_key",
    }


def test_flags_override_the_environment_and_nested_settings_merge(monkeypatch) -> None:
    monkeypatch.setenv("GATEWAY_ADMISSION__MAX_RUNNING", "8")
    monkeypatch.setenv("GATEWAY_ADMISSION__MAX_WAITING", "16")
    monkeypatch.setenv("GATEWAY_ENGINE__ENGINE_ARGS", '{"a": 1, "b": 1}')
    monkeypatch.setenv("GATEWAY_WARMUP", "true")
    given = settings("--admission-max-running", "4", "--engine-arg", "b=2", "--no-warmup",
                     "--cache-backend", "redis", "--cache-redis-url", "redis://r:6379/0",
                     "--sampling-defaults-temperature", "0.7")
    assert (given.admission.max_running, given.admission.max_waiting) == (4, 16)
    assert given.engine.engine_args == {"a": 1, "b": 2}
    assert given.warmup is False
    assert (given.cache.backend, given.cache.redis_url) == ("redis", "redis://r:6379/0")
    assert given.engine.sampling_defaults.temperature == 0.7


def test_the_log_format_flag_reaches_vllms_log_lines_too() -> None:
    given = settings("--log-format", "json", "--engine-log-level", "error")
    assert (given.engine.log_format, given.engine.log_level) == ("json", "error")


@pytest.mark.parametrize("argv", [
    ["serve", "--no-such-flag"],
    ["serve", "--port", "eighty"],
    ["serve", "--enforce-eager", "yes"],
    ["serve", "--tls-client-auth", "sometimes"],
    ["serve", "--engine-arg", "no-equals-sign"],
    ["serve", "--admission-queue-share", "{not json"],
    ["serve", "--api-keys", '["sk-a"]'],  # secrets: the environment only
    ["serve", "--served", "x"],  # no abbreviations: a unique prefix today is ambiguous once a setting is added
    [],
])
def test_a_bad_command_line_exits_2(argv: list[str], capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        cli.main(argv)
    assert exited.value.code == 2
    assert "usage: llm-gateway" in capsys.readouterr().err


def test_help_names_each_flag_with_its_variable_and_default(capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        parser().parse_args(["serve", "--help"])
    assert exited.value.code == 0
    text = " ".join(capsys.readouterr().out.split())
    assert "--max-model-len INT Context length" in text
    assert "[GATEWAY_ENGINE__MAX_MODEL_LEN; default: 2048]" in text
    assert "--enforce-eager, --no-enforce-eager" in text
    assert "--tls-cert-file PATH" in text
