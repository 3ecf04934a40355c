"""The Files API's routes: upload, list, retrieve, download, delete; each through the asking tenant's view of the
store."""

from __future__ import annotations

import asyncio

from starlette.requests import Request
from starlette.responses import Response, StreamingResponse

from gateway.apis.batches.batches_input import check_batch_input
from gateway.apis.files.files_multipart import read_form
from gateway.apis.files.files_wire import PURPOSES, FileDeleted, FileList, FileListQuery
from gateway.errors import InvalidRequest
from gateway.pipeline.context import context_of
from gateway.protocol.openai import listing
from gateway.stores.batches import OwnedFiles
from gateway.web.answers import json_response
from gateway.web.requests import state_of

_FIELDS = ("purpose", "expires_after[anchor]", "expires_after[seconds]")
_MIN_EXPIRY_S, _MAX_EXPIRY_S = 3600, 30 * 86400  # OpenAI's bounds on expires_after.seconds


def _mine(request: Request) -> OwnedFiles:
    return state_of(request).files.of(context_of(request.scope).tenant)


def _check_field(name: str, value: str) -> None:
    if name not in _FIELDS:
        raise InvalidRequest(f"Unrecognized request argument supplied: {name[:64]}", param=name[:64])
    if name == "purpose" and value not in PURPOSES:
        raise InvalidRequest(f"Invalid value for 'purpose': '{value[:64]}'. This gateway takes files of purpose "
                             f"{', '.join(repr(p) for p in PURPOSES)} (the input of a batch).", param="purpose")
    if name == "expires_after[anchor]" and value != "created_at":
        raise InvalidRequest("Invalid value for 'expires_after.anchor': it must be 'created_at'.", "expires_after.anchor")


def _expiry(fields: dict[str, str], default_s: int) -> int:
    raw = fields.get("expires_after[seconds]")
    if raw is None:
        return default_s
    if not (raw.isascii() and raw.isdigit()) or not _MIN_EXPIRY_S <= int(raw) <= _MAX_EXPIRY_S:
        raise InvalidRequest("Invalid value for 'expires_after.seconds': it must be an integer from "
                             f"{_MIN_EXPIRY_S} to {_MAX_EXPIRY_S}.", "expires_after.seconds")
    return int(raw)


async def upload(request: Request) -> Response:
    settings, mine = state_of(request).settings.files, _mine(request)
    form = await read_form(request, mine.stage, settings.max_bytes, _check_field)
    try:
        if "purpose" not in form.fields:
            raise InvalidRequest("Missing required parameter: 'purpose'", param="purpose")
        if form.file is None:
            raise InvalidRequest("Missing required parameter: 'file'", param="file")
        expires_after_s = _expiry(form.fields, settings.expires_after_s)
        _, problems = await asyncio.to_thread(check_batch_input, form.file.path, None, 1, settings.max_lines,
                                              settings.max_line_bytes)
        if problems:
            raise InvalidRequest(str(problems[0].message), param="file")
        stored = await mine.put(form.file, form.filename, "batch", expires_after_s)
    finally:
        if form.file is not None:
            await form.file.discard()  # nothing left to remove once stored
    return json_response(stored)


async def list_files(request: Request) -> Response:
    query = FileListQuery.model_validate(dict(request.query_params))
    page, more = await _mine(request).page(query.purpose, query.after, query.limit, query.order == "desc")
    return json_response(listing(FileList, page, more))


async def retrieve(request: Request) -> Response:
    return json_response(await _mine(request).get(request.path_params["file_id"]))


async def delete(request: Request) -> Response:
    file_id = request.path_params["file_id"]
    await _mine(request).delete(file_id)
    return json_response(FileDeleted(id=file_id))


async def content(request: Request) -> Response:
    """The file as uploaded, streamed; opened before the answer starts, so a delete meanwhile does not cut it short."""
    _, opened = await _mine(request).open(request.path_params["file_id"])
    headers = {"content-length": str(opened.size)}
    return StreamingResponse(opened.chunks, media_type="application/octet-stream", headers=headers)
