"""The Files API (/v1/files) through the official `openai` SDK and by hand: upload, list, retrieve,
content, delete; a batch file checked line by line; the size limit; and ownership: another key's
file answers exactly as an unknown one on every route, and touches nothing; an id is only an id."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from starlette.testclient import TestClient

from gateway.errors import NotFound
from gateway.stores import batches as store
from tests.fakes import app_with
from tests.stores import disk_files
from tests.unit.test_responses import sdk_for

KEYS = ["sk-owner", "sk-other"]
UNKNOWN = "file-0123456789abcdef01234567"


def line(custom_id: str = "r1", **changes: Any) -> dict[str, Any]:
    request = {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
               "body": {"model": "fake-model", "messages": [{"role": "user", "content": "hi"}]}}
    return {**request, **changes}


def jsonl(*requests: dict[str, Any]) -> bytes:
    return b"".join(json.dumps(r).encode() + b"\n" for r in requests)


GOOD = jsonl(line("r1"), line("r2", url="/v1/embeddings", body={"model": "e", "input": "x"}))


def auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


def upload(client: TestClient, content: bytes, key: str = "sk-owner", purpose: str = "batch", **data: str) -> Any:
    return client.post("/v1/files", files={"file": ("in.jsonl", content)}, data={"purpose": purpose, **data},
                       headers=auth(key))


@pytest.fixture
def client(tmp_path: Path) -> Iterator[TestClient]:
    with TestClient(app_with(api_keys=KEYS, files={"dir": tmp_path / "files"})) as test_client:
        yield test_client


def contents(directory: Path) -> list[Path]:
    """The uploads' contents (the records are in the directory's database)."""
    return sorted(p for p in directory.rglob("*") if p.is_file() and not p.name.startswith("files.sqlite3"))


def stored_files(tmp_path: Path) -> list[Path]:
    return contents(tmp_path / "files")


def test_the_sdk_uploads_lists_retrieves_downloads_and_deletes(client: TestClient, tmp_path: Path) -> None:
    sdk = sdk_for(client, "sk-owner")
    made = sdk.files.create(file=("requests.jsonl", GOOD), purpose="batch")
    assert made.id.startswith("file-")
    assert made.object == "file"
    assert (made.bytes, made.filename, made.purpose, made.status) == (len(GOOD), "requests.jsonl", "batch", "processed")
    assert made.expires_at == made.created_at + 30 * 86400  # OpenAI's default for batch files
    assert sdk.files.retrieve(made.id) == made
    assert [f.id for f in sdk.files.list()] == [made.id]
    assert sdk.files.content(made.id).read() == GOOD
    assert sdk.files.delete(made.id).model_dump() == {"id": made.id, "object": "file", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(made.id)
    assert list(sdk.files.list()) == []
    assert stored_files(tmp_path) == []  # content and metadata both gone


def test_content_is_streamed_back_byte_for_byte(client: TestClient) -> None:
    big = jsonl(*(line(f"r{i}", body={"model": "m", "prompt": "x" * 1000}) for i in range(600)))  # > 2 chunks
    made = upload(client, big).json()
    answer = client.get(f"/v1/files/{made['id']}/content", headers=auth("sk-owner"))
    assert answer.status_code == 200
    assert answer.headers["content-length"] == str(len(big))
    assert answer.content == big


def test_expires_after_is_taken_within_openai_s_bounds(client: TestClient) -> None:
    made = upload(client, GOOD, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "3600"}).json()
    assert made["expires_at"] == made["created_at"] + 3600
    refused = upload(client, GOOD, **{"expires_after[anchor]": "created_at", "expires_after[seconds]": "60"})
    assert (refused.status_code, refused.json()["error"]["param"]) == (400, "expires_after.seconds")


def test_list_pages_as_openai_does(client: TestClient) -> None:
    sdk = sdk_for(client, "sk-owner")
    made = [sdk.files.create(file=(f"{i}.jsonl", GOOD), purpose="batch").id for i in range(3)]
    newest_first = [f.id for f in sdk.files.list()]
    assert sorted(newest_first) == sorted(made)
    assert [f.id for f in sdk.files.list(order="asc")] == newest_first[::-1]
    page = sdk.files.list(limit=2)
    assert ([f.id for f in page.data], page.has_more) == (newest_first[:2], True)
    rest = sdk.files.list(limit=2, after=newest_first[1])
    assert ([f.id for f in rest.data], rest.has_more) == (newest_first[2:], False)
    assert sum(len(p.data) for p in sdk.files.list(limit=1).iter_pages()) == 3
    assert list(sdk.files.list(purpose="fine-tune")) == []
    with pytest.raises(openai.BadRequestError) as bad:
        sdk.files.list(limit=0)
    assert bad.value.body["param"] == "limit"  # type: ignore[index]


@pytest.mark.parametrize(("content", "number", "says"), [
    (b'{"custom_id": "r1", "method": "POST"\n', 1, "not valid JSON"),
    (jsonl(line("r1")) + b"[1, 2]\n", 2, "not a JSON object"),
    (jsonl(line("r1"), {k: v for k, v in line().items() if k != "custom_id"}), 2, "custom_id"),
    (jsonl(line("r1"), line("r2"), line("r1")), 3, "repeats the custom_id 'r1'"),
    (jsonl(line("r1"), line("r2", url="/v1/images/generations")), 2, "unsupported 'url'"),
    (jsonl(line("r1", method="GET")), 1, "'method': 'POST'"),
    (jsonl(line("r1", body="hi")), 1, "'body' object"),
    (jsonl(line("r1", extra=1)), 1, "unrecognized field 'extra'"),
    (jsonl(line("r1")) + b"\n" + jsonl(line("r2")), 2, "empty"),
])
def test_a_bad_line_is_a_400_naming_it_and_nothing_is_stored(
    client: TestClient, tmp_path: Path, content: bytes, number: int, says: str
) -> None:
    refused = upload(client, content)
    assert refused.status_code == 400
    error = refused.json()["error"]
    assert error["message"].startswith(f"Line {number} of the batch file"), error
    assert says in error["message"]
    assert (error["param"], error["type"]) == ("file", "invalid_request_error")
    assert stored_files(tmp_path) == []  # the staged upload removed too


def test_an_empty_file_and_too_many_lines_are_refused(tmp_path: Path) -> None:
    with TestClient(app_with(api_keys=KEYS, files={"dir": tmp_path / "files", "max_lines": 2})) as client:
        assert "empty" in upload(client, b"").json()["error"]["message"]
        refused = upload(client, jsonl(line("a"), line("b"), line("c")))
        assert (refused.status_code, refused.json()["error"]["param"]) == (400, "file")
        assert "more than 2 requests" in refused.json()["error"]["message"]
        assert upload(client, jsonl(line("a"), line("b"))).status_code == 200


@pytest.mark.parametrize(("purpose", "status"), [("batch", 200), ("fine-tune", 400), ("user_data", 400), ("", 400)])
def test_only_batch_files_are_taken(client: TestClient, tmp_path: Path, purpose: str, status: int) -> None:
    answer = upload(client, GOOD, purpose=purpose)
    assert answer.status_code == status
    if status == 400:
        assert answer.json()["error"]["param"] == "purpose"
        assert stored_files(tmp_path) == []


def test_a_form_without_its_fields_or_not_a_form_is_a_400(client: TestClient) -> None:
    no_purpose = client.post("/v1/files", files={"file": ("a.jsonl", GOOD)}, headers=auth("sk-owner"))
    assert (no_purpose.status_code, no_purpose.json()["error"]["param"]) == (400, "purpose")
    no_file = client.post("/v1/files", files={"purpose": (None, "batch")}, headers=auth("sk-owner"))
    assert (no_file.status_code, no_file.json()["error"]["param"]) == (400, "file")
    two = client.post("/v1/files", files=[("file", ("a", GOOD)), ("file", ("b", GOOD))], data={"purpose": "batch"},
                      headers=auth("sk-owner"))
    assert two.status_code == 400
    extra = upload(client, GOOD, other="x")
    assert "Unrecognized request argument supplied: other" in extra.json()["error"]["message"]
    as_json = client.post("/v1/files", json={"purpose": "batch"}, headers=auth("sk-owner"))
    assert as_json.status_code == 400
    assert "multipart/form-data" in as_json.json()["error"]["message"]


def test_a_body_cut_short_is_a_400_and_leaves_nothing(client: TestClient, tmp_path: Path) -> None:
    boundary = "xyz"
    body = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.jsonl\"\r\n\r\n").encode() + GOOD
    cut = client.post("/v1/files", content=body, headers={
        **auth("sk-owner"), "content-type": f"multipart/form-data; boundary={boundary}"})
    assert cut.status_code == 400
    assert "closing boundary" in cut.json()["error"]["message"]
    assert stored_files(tmp_path) == []


def test_an_oversize_file_is_a_413_declared_or_streamed(tmp_path: Path) -> None:
    files = {"dir": tmp_path / "files", "max_bytes": 1000}
    with TestClient(app_with(api_keys=KEYS, files=files)) as client:
        assert upload(client, jsonl(line("a"))).status_code == 200
        big = jsonl(*(line(f"r{i}") for i in range(20)))  # ~2.5 KB: past the file limit, within the form's slack
        refused = upload(client, big)
        assert (refused.status_code, refused.json()["error"]["code"]) == (413, "request_too_large")
        declared = client.post("/v1/files", content=b"x" * 70_000, headers={
            **auth("sk-owner"), "content-type": "multipart/form-data; boundary=b"})
        assert declared.status_code == 413
        chunked = client.post("/v1/files", content=iter([b"--b\r\nContent-Disposition: form-data; name=\"file\"; "
                                                         b"filename=\"a\"\r\n\r\n", big, b"\r\n--b--\r\n"]),
                              headers={**auth("sk-owner"), "content-type": "multipart/form-data; boundary=b"})
        assert chunked.status_code == 413  # no Content-Length: counted as it streams
        assert len(stored_files(tmp_path)) == 1


def test_an_upload_is_not_held_in_the_in_memory_body_budget(tmp_path: Path) -> None:
    settings = {"max_body_bytes": 1024, "max_body_bytes_in_flight": 1024, "files": {"dir": tmp_path / "files"}}
    big = jsonl(*(line(f"r{i}") for i in range(100)))  # ~12 KB, far past the budget
    with TestClient(app_with(api_keys=KEYS, **settings)) as client:
        assert upload(client, big).status_code == 200
        huge = client.post("/v1/chat/completions", content=b"x" * 2048,
                           headers={**auth("sk-owner"), "content-type": "application/json"})
        assert huge.status_code in (413, 503)  # JSON routes keep their bounds


def test_without_keys_an_upload_needs_a_credential_header(tmp_path: Path) -> None:
    """A web page's form can post multipart/form-data cross-site; it cannot add an Authorization header."""
    with TestClient(app_with(files={"dir": tmp_path / "files"})) as client:
        as_a_form = client.post("/v1/files", files={"file": ("a.jsonl", GOOD)}, data={"purpose": "batch"})
        assert as_a_form.status_code == 415
        assert stored_files(tmp_path) == []
        assert sdk_for(client).files.create(file=("a.jsonl", GOOD), purpose="batch").status == "processed"
        assert client.post("/v1/chat/completions", files={"file": ("a", b"x")}, headers=auth("x")).status_code == 415


def attempts(file_id: str) -> list[tuple[str, str]]:
    """Every way a request can name a stored file."""
    return [("GET", f"/v1/files/{file_id}"), ("GET", f"/v1/files/{file_id}/content"),
            ("DELETE", f"/v1/files/{file_id}"), ("GET", f"/v1/files?after={file_id}")]


def test_another_key_s_file_answers_as_an_unknown_one_and_touches_nothing(client: TestClient, tmp_path: Path) -> None:
    theirs = upload(client, GOOD, key="sk-owner").json()
    before = {p: p.read_bytes() for p in stored_files(tmp_path)}
    for (method, path), (_, unknown_path) in zip(attempts(theirs["id"]), attempts(UNKNOWN), strict=True):
        refused = client.request(method, path, headers=auth("sk-other"))
        expected = client.request(method, unknown_path, headers=auth("sk-other"))
        assert refused.status_code == expected.status_code != 200, (method, path)
        body = expected.json()
        body["error"]["message"] = body["error"]["message"].replace(UNKNOWN, theirs["id"])
        assert refused.json() == body, (method, path)
    assert client.get("/v1/files", headers=auth("sk-other")).json()["data"] == []
    assert {p: p.read_bytes() for p in stored_files(tmp_path)} == before  # nothing deleted or changed
    assert client.get(f"/v1/files/{theirs['id']}", headers=auth("sk-owner")).json() == theirs


def test_a_content_is_named_by_its_id_never_by_the_tenant(client: TestClient, tmp_path: Path) -> None:
    made = [upload(client, GOOD, key=key).json()["id"] for key in KEYS]
    assert sorted(p.name for p in stored_files(tmp_path) if p.parent.name != ".spool") == sorted(made)
    assert list((tmp_path / "files" / ".spool").iterdir()) == []  # the uploads' spool: each handed to the store


ODD_IDS = ["..", "../x", "..%2F..%2Fetc%2Fpasswd", "%2E%2E", "file-..", "file-0123456789abcdef01234567.json",
           "FILE-0123456789ABCDEF01234567", "file-0123456789abcdef0123456", "file-0123456789abcdef01234567%2F..",
           "file-0123456789abcdef01234567%00", ".upload-x", "x" * 300]


@pytest.mark.parametrize("odd", ODD_IDS)
def test_an_odd_id_is_a_404_on_every_route(client: TestClient, tmp_path: Path, odd: str) -> None:
    made = upload(client, GOOD).json()
    outside = tmp_path / "secret"
    outside.write_text("not yours")
    for method, path in attempts(odd)[:3]:
        answer = client.request(method, path, headers=auth("sk-owner"))
        assert answer.status_code == 404, (method, path, answer.text)
        assert "not yours" not in answer.text
    assert outside.read_text() == "not yours"
    assert client.get(f"/v1/files/{made['id']}/content", headers=auth("sk-owner")).content == GOOD


@pytest.mark.parametrize("odd", ["../x", "..", "/etc/passwd", "file-0123456789abcdef01234567/../x", "", "a\x00b",
                                 f"{UNKNOWN}.json"])
async def test_the_store_builds_no_path_from_what_is_not_an_id(tmp_path: Path, odd: str) -> None:
    mine = disk_files(tmp_path).of("t")
    for call in (mine.get(odd), mine.open(odd), mine.delete(odd)):
        with pytest.raises(NotFound):
            await call
    assert not (tmp_path / "x").exists()


async def test_an_expired_file_is_gone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    mine = disk_files(tmp_path).of("t")
    staged = await mine.stage()
    await staged.write(GOOD)
    made = await mine.put(staged, "a.jsonl", "batch", 3600)
    assert await mine.get(made.id) == made
    later = made.created_at + 3601
    monkeypatch.setattr(store.time, "time", lambda: later)
    with pytest.raises(NotFound):
        await mine.get(made.id)
    assert await mine.page(None, None, 10, True) == ([], False)
    assert await asyncio.to_thread(contents, tmp_path) == []  # its content removed with its record


async def test_a_download_outlives_a_delete_meanwhile(tmp_path: Path) -> None:
    mine = disk_files(tmp_path).of("t")
    staged = await mine.stage()
    await staged.write(GOOD)
    made = await mine.put(staged, "a.jsonl", "batch", 3600)
    _, opened = await mine.open(made.id)
    await mine.delete(made.id)
    assert opened.size == len(GOOD)
    assert b"".join([chunk async for chunk in opened.chunks]) == GOOD
