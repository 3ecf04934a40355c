"""Client-supplied names and paths (issue 40 item 6): whatever the file system or the engine says of a name or path a
client sends (missing, a directory where a file belongs, a file where a directory does, a name too long, a loop of
links, no permission, a NUL character, a pipe, an endless device), the answer is a 4xx in the API's error shape naming
the field, never a 5xx; the message names the object it is about. Fuzzed with hypothesis over the admin API's adapter
routes and the Files API, on the fake engine (tests/integration/test_adapters.py: the real engine's refusals)."""

from __future__ import annotations

import contextlib
import errno
import itertools
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from starlette.testclient import TestClient

from engine import adapters
from gateway.app import create_app
from tests.adapters import write_stub
from tests.fakes import FakeEngine, fake_settings

FUZZ = settings(max_examples=60, deadline=None, database=None, suppress_health_check=list(HealthCheck))
ADMIN = {"Authorization": "Bearer sk-admin"}
KEY = {"Authorization": "Bearer sk-key"}  # an upload is taken with a credential only
LOAD_FIELDS = {"lora_name", "lora_path", "base", "load_inplace"}


def _zoo(folder: Path) -> dict[str, Path]:
    """Adapter directories and the ways a path can go wrong, on disk."""
    good = write_stub(folder / "good")
    (folder / "config-is-a-dir" / "adapter_config.json").mkdir(parents=True)
    no_weights = folder / "no-weights"
    no_weights.mkdir()
    (no_weights / "adapter_config.json").write_text((good / "adapter_config.json").read_text())
    weights_dir = write_stub(folder / "weights-is-a-dir")
    (weights_dir / "adapter_model.safetensors").unlink()
    (weights_dir / "adapter_model.safetensors").mkdir()
    endless = write_stub(folder / "endless")
    (endless / "adapter_model.bin").symlink_to("/dev/zero")  # hashed, it would never end
    piped = folder / "piped"
    piped.mkdir()
    os.mkfifo(piped / "adapter_config.json")  # read, it would wait for a writer forever
    (folder / "loop").symlink_to(folder / "loop")
    (folder / "a-file").write_text("not a directory")
    looped = write_stub(folder / "looped-config")
    (looped / "adapter_config.json").unlink()
    (looped / "adapter_config.json").symlink_to(looped / "adapter_config.json")
    numbered = write_stub(folder / "modules-a-number")
    (numbered / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "target_modules": 5}))
    nested = "[" * 100_000 + "]" * 100_000  # past the JSON parser's depth
    (write_stub(folder / "nested-config") / "adapter_config.json").write_text(nested)
    header = write_stub(folder / "nested-header") / "adapter_model.safetensors"
    header.write_bytes(len(nested).to_bytes(8, "little") + nested.encode())
    return {path.name: path for path in folder.iterdir()}


@pytest.fixture(scope="module")
def zoo(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return _zoo(tmp_path_factory.mktemp("zoo"))


@pytest.fixture(scope="module")
def client(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TestClient]:
    folder = tmp_path_factory.mktemp("gateway")
    (folder / "models.yaml").write_text("models:\n  - {name: base, engine: {enable_lora: true, max_loras: 2}}\n")
    settings = fake_settings(models_file=folder / "models.yaml", admin_keys=["sk-admin"], api_keys=["sk-key"],
                             cache={"backend": "memory"})

    def start(engine: Any) -> FakeEngine:
        return FakeEngine(engine.served_model_name, max_loras=engine.max_loras)

    with TestClient(create_app(settings, engine_starter=start), raise_server_exceptions=False) as found:
        yield found


def assert_refused_cleanly(answer: Any, fields: set[str] | None = None) -> dict[str, Any]:
    """No 5xx; a refusal is OpenAI's error object, naming one of `fields` when the body was a JSON object of them."""
    assert answer.status_code < 500, (answer.status_code, answer.text[:500])
    if answer.status_code < 400:
        return {}
    error = answer.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["message"]
    if fields is not None:
        assert error["param"] in fields, error
    return dict(error)


def _paths(zoo: dict[str, Path]) -> st.SearchStrategy[str]:
    component = st.sampled_from(["x" * 300, "x" * 255, "..", ".", "", "\x00", "a\x00b", "é" * 200, "a,b", " "])
    on_disk = st.sampled_from(sorted(str(path) for path in zoo.values()))
    below = st.tuples(on_disk, st.sampled_from(["", "/", "/x", "/adapter_config.json", "/" + "y" * 300, "/..", "/\x00"]))
    return st.one_of(
        on_disk, below.map("".join), st.lists(component, min_size=1, max_size=5).map("/".join),
        st.lists(component, max_size=3).map(lambda parts: "/" + "/".join(parts)), st.text(max_size=50),
        st.just("/" + "z" * 5000), st.just("/" + "/".join(["d" * 200] * 25)),  # past PATH_MAX
    )


names = st.one_of(st.text(max_size=20), st.sampled_from(["x" * 300, "\x00", "a/b", "../x", "a,b", "good", "base", "é"]))
json_any = st.none() | st.booleans() | st.integers() | st.text(max_size=10) | st.lists(st.integers(), max_size=2)


def test_no_adapter_load_or_unload_is_a_server_error(client: TestClient, zoo: dict[str, Path]) -> None:
    good = st.tuples(st.just("fine"), st.just(str(zoo["good"])))  # so that some loads are taken

    @FUZZ
    @given(named=good | st.tuples(names, _paths(zoo)),
           base=st.none() | st.sampled_from(["base", "ghost", ""]) | st.text(max_size=5),
           extra=st.none() | st.dictionaries(st.sampled_from([*LOAD_FIELDS, "bogus"]), json_any, max_size=2))
    def check(named: tuple[str, str], base: str | None, extra: dict[str, Any] | None) -> None:
        name, path = named
        body = {"lora_name": name, "lora_path": path, **({} if base is None else {"base": base}), **(extra or {})}
        loaded = client.post("/v1/load_lora_adapter", content=json.dumps(body), headers=ADMIN)
        assert_refused_cleanly(loaded, LOAD_FIELDS)
        unloaded = client.post("/v1/unload_lora_adapter", content=json.dumps({"lora_name": body["lora_name"]}),
                               headers=ADMIN)
        assert_refused_cleanly(unloaded, {"lora_name"})
        assert (unloaded.status_code == 200) == (loaded.status_code == 200)  # what loaded unloads: the room stays
        outcomes.add(loaded.status_code)

    outcomes: set[int] = set()
    check()
    assert {200, 400} <= outcomes


# (the path, what the refusal says): each names the adapter and the object it is about
REFUSALS = [
    ("/tmp/" + "x" * 300, "is a name too long"),
    ("{loop}", "is a loop of symbolic links"),
    ("{a-file}", "is not a directory"),
    ("{a-file}/x", "does not exist"),
    ("/tmp/a\x00b", "is not a path"),
    ("{config-is-a-dir}", "has no adapter_config.json file"),
    ("{no-weights}", "has no weights"),
    ("{weights-is-a-dir}", "has no weights"),
    ("{piped}", "has no adapter_config.json file"),
    ("{looped-config}", "adapter_config.json is a loop of symbolic links"),
    ("{modules-a-number}", "adapter_config.json: its target_modules is not a module name or a list of them"),
    ("{nested-config}", "adapter_config.json is not valid JSON"),
    ("{nested-header}", "adapter_model.safetensors is not a safetensors file"),
]


@pytest.mark.parametrize(("path", "refusal"), REFUSALS)
def test_each_refusal_names_the_adapter_and_what_is_wrong(
    client: TestClient, zoo: dict[str, Path], path: str, refusal: str
) -> None:
    path = path.format(**{name: str(found) for name, found in zoo.items()})
    answer = client.post("/v1/load_lora_adapter", json={"lora_name": "named", "lora_path": path}, headers=ADMIN)
    assert answer.status_code == 400, answer.text
    error = assert_refused_cleanly(answer, {"lora_path"})
    assert error["message"].startswith("the adapter 'named': ")
    assert refusal in error["message"]


def test_an_endless_weights_file_is_not_read(client: TestClient, zoo: dict[str, Path]) -> None:
    """A weights path that is a device (/dev/zero) is not hashed (it would never end): only regular files are."""
    answer = client.post("/v1/load_lora_adapter", json={"lora_name": "endless", "lora_path": str(zoo["endless"])},
                         headers=ADMIN)
    assert answer.status_code == 200, answer.text
    assert client.post("/v1/unload_lora_adapter", json={"lora_name": "endless"}, headers=ADMIN).status_code == 200


# a value of each JSON type, where a name, a number or a list belongs
WRONG = [None, True, 0, 5, -1.5, 2**70, "", "x", [], [1, "a"], [[8]], {}, {"a": 1}]
CONFIG = {"peft_type": "LORA", "r": 8, "target_modules": ["q_proj"], "base_model_name_or_path": "m"}
HEADER = {"m.q_proj.lora_A.weight": {"shape": [8, 4]}, "m.q_proj.lora_B.weight": {"shape": [4, 8]}}


def _each_changed(good: dict[str, Any]) -> Iterator[Any]:
    """`good` with each of its fields (and each field's shape) each WRONG value, and each WRONG value for it."""
    for field, value in itertools.product(good, WRONG):
        yield {**good, field: value}
        if isinstance(good[field], dict):
            yield {**good, field: {**good[field], "shape": value}}
    yield from WRONG


def test_no_adapter_file_s_content_is_anything_but_an_adapter_error(tmp_path: Path) -> None:
    """Whatever JSON the config and the safetensors header hold (each JSON type where a number, a name or a list
    belongs), reading the adapter and fitting it to a model give an answer or an AdapterError, nothing else."""
    folder = write_stub(tmp_path / "a")
    cases = [(config, HEADER) for config in _each_changed(CONFIG)] + [(CONFIG, h) for h in _each_changed(HEADER)]
    for config, header in cases:
        (folder / "adapter_config.json").write_text(json.dumps(config))
        encoded = json.dumps(header).encode()
        (folder / "adapter_model.safetensors").write_bytes(len(encoded).to_bytes(8, "little") + encoded)
        with contextlib.suppress(adapters.AdapterError):
            adapters.read(folder).misfit(4)


@pytest.mark.parametrize("code", [errno.EACCES, errno.EPERM, errno.ENAMETOOLONG, errno.ELOOP, errno.EIO, errno.ENOTDIR])
@pytest.mark.parametrize("step", ["directory", "config", "weights"])
def test_every_refusal_of_the_file_system_is_an_adapter_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, code: int, step: str
) -> None:
    """Whatever errno the file system answers with, at whichever file (the tests run as root: no permission is ever
    refused here, so the refusal is made), reading and hashing raise AdapterError naming the path."""
    folder = write_stub(tmp_path / "a")
    refused = {"directory": folder, "config": folder / "adapter_config.json",
               "weights": folder / "adapter_model.safetensors"}[step]
    stat, opened = os.stat, Path.open

    def refuse(path: Any) -> None:
        if Path(path) == refused:
            raise OSError(code, os.strerror(code), str(path))

    monkeypatch.setattr(adapters.os, "stat", lambda path, *a, **k: refuse(path) or stat(path, *a, **k))
    monkeypatch.setattr(Path, "open", lambda self, *a, **k: refuse(self) or opened(self, *a, **k))
    for reading in (adapters.read, adapters.digest):
        with pytest.raises(adapters.AdapterError, match=str(refused).replace(".", r"\.")):
            reading(folder)


file_ids = st.one_of(st.text(max_size=40), st.sampled_from(["file-" + "0" * 24, "x" * 300, "%00", "..", "file-%2F..",
                                                            "a%00b", "%FF%FE", "file-" + "a" * 500]))


def test_no_files_route_is_a_server_error(client: TestClient) -> None:
    @FUZZ
    @given(file_id=file_ids, method=st.sampled_from(["GET", "DELETE"]), content=st.booleans())
    def check(file_id: str, method: str, content: bool) -> None:
        path = f"/v1/files/{quote(file_id, safe='%/')}" + ("/content" if content and method == "GET" else "")
        assert_refused_cleanly(client.request(method, path, headers=KEY))

    check()


filenames = st.one_of(st.text(max_size=30), st.sampled_from(["x" * 300, "../../etc/passwd", "/", "a\x00b", ".", ""]))


def test_no_upload_name_or_field_is_a_server_error(client: TestClient) -> None:
    @FUZZ
    @given(filename=filenames, raw_name=st.binary(max_size=20), purpose=st.text(max_size=10) | st.just("batch"),
           use_raw=st.booleans(), field=st.sampled_from(["purpose", "expires_after[seconds]", "x" * 300, "\x00"]))
    def check(filename: str, raw_name: bytes, purpose: str, use_raw: bool, field: str) -> None:
        line = json.dumps({"custom_id": "1", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "base", "messages": [{"role": "user", "content": "hi"}]}})
        name = raw_name if use_raw else json.dumps(filename).encode()[1:-1]
        body = (b"--b\r\nContent-Disposition: form-data; name=\"" + field.encode() + b"\"\r\n\r\n" + purpose.encode()
                + b"\r\n--b\r\nContent-Disposition: form-data; name=\"file\"; filename=\"" + name + b"\"\r\n\r\n"
                + line.encode() + b"\n\r\n--b--\r\n")
        answer = client.post("/v1/files", content=body, headers={**KEY, "Content-Type": "multipart/form-data; boundary=b"})
        assert_refused_cleanly(answer)
        outcomes.add(answer.status_code)
        if answer.status_code == 200:
            assert client.delete(f"/v1/files/{answer.json()['id']}", headers=KEY).status_code == 200

    outcomes: set[int] = set()
    check()
    assert {200, 400} <= outcomes  # uploads taken and refused, not all stopped at the door
