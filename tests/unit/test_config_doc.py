"""docs/configuration.md is generated from the Settings classes (gateway.server.config_doc) and
must be what the generator prints now; every setting it lists has a description and an
environment variable that Settings really reads."""

from __future__ import annotations

import difflib
from pathlib import Path

import pytest

from gateway.server import config_doc
from gateway.server.options import options
from gateway.settings import Settings

REFERENCE = Path(__file__).parents[2] / "docs" / "configuration.md"


def test_the_configuration_reference_is_current() -> None:
    written = REFERENCE.read_text() if REFERENCE.exists() else ""
    generated = config_doc.render()
    if written != generated:
        diff = "".join(list(difflib.unified_diff(written.splitlines(True), generated.splitlines(True),
                                                 "docs/configuration.md", "generated"))[:40])
        pytest.fail("docs/configuration.md is stale: regenerate it with `make docs` "
                    f"(python -m gateway.server.config_doc > docs/configuration.md)\n{diff}")


def test_every_setting_has_a_description() -> None:
    assert [o.name for o in options() if not o.description] == []


def test_the_reference_has_a_row_for_every_setting() -> None:
    text = config_doc.render()
    for option in options():
        assert f"| `{option.name}` | `{option.env}` |" in text, option.name


@pytest.mark.parametrize(("env", "value", "read"), [
    ("GATEWAY_PORT", "9001", lambda s: s.port),
    ("GATEWAY_TLS__MIN_VERSION", "TLSv1.3", lambda s: s.tls.min_version),
    ("GATEWAY_CACHE__REDIS_PREFIX", "x:", lambda s: s.cache.redis_prefix),
    ("GATEWAY_ADMISSION__QUEUE_SHARE", '{"normal": 0.8}', lambda s: s.admission.queue_share),
    ("GATEWAY_ENGINE__ENFORCE_EAGER", "true", lambda s: s.engine.enforce_eager),
    ("GATEWAY_ENGINE__SAMPLING_DEFAULTS__TOP_P", "0.5", lambda s: s.engine.sampling_defaults.top_p),
])
def test_the_environment_variables_it_names_are_the_ones_settings_reads(monkeypatch, env, value, read) -> None:
    assert env in {o.env for o in options()}
    before = read(Settings())
    monkeypatch.setenv(env, value)
    assert read(Settings()) != before
