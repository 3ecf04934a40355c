"""A `multipart/form-data` upload read as it arrives by python-multipart, its one file part written chunk by chunk to
the store's local spool (Starlette's parser would spool it to a temporary directory first), bounded in parts, field
size and file size."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import ClientDisconnect, Request

from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.stores.blobs import Staged

MAX_PARTS = 16
MAX_FIELD_BYTES = 1024
MAX_FILENAME_CHARS = 255
_MULTIPART_SLACK = 64 * 1024  # the boundaries, part headers and small fields around the file


@dataclass(slots=True)
class Form:
    fields: dict[str, str] = field(default_factory=dict)
    file: Staged | None = None
    filename: str = ""


@dataclass(slots=True)
class _Part:
    name: str = ""
    filename: str | None = None
    data: bytearray = field(default_factory=bytearray)


class _Reader:
    def __init__(self, max_file_bytes: int, on_field: Callable[[str, str], None]) -> None:
        self.form = Form()
        self.max_file_bytes = max_file_bytes
        self.on_field = on_field
        self.pending: list[bytes] = []  # file bytes parsed from the last chunk, to write
        self.file_bytes = 0
        self.parts = 0
        self.ended = False  # the closing boundary was read (a body cut short has none)
        self._part = _Part()
        self._header_name = bytearray()
        self._header_value = bytearray()

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise InvalidRequest(f"The form has more than {MAX_PARTS} parts")
        self._part = _Part()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]
        if len(self._header_value) > MAX_FIELD_BYTES:
            raise InvalidRequest("A part of the form has a header that is too long")

    def on_header_end(self) -> None:
        if bytes(self._header_name).lower() == b"content-disposition":
            _, options = parse_options_header(bytes(self._header_value))
            self._part.name = options.get(b"name", b"").decode("utf-8", "replace")
            raw_filename = options.get(b"filename")
            if raw_filename is not None:
                self._part.filename = raw_filename.decode("utf-8", "replace")[-MAX_FILENAME_CHARS:]
        self._header_name.clear()
        self._header_value.clear()

    def on_headers_finished(self) -> None:
        if not self._part.name:
            raise InvalidRequest("A part of the form has no name (Content-Disposition: form-data; name=...)")
        if self._part.filename is not None and (self._part.name != "file" or self.form.filename):
            raise InvalidRequest("The form must carry exactly one file, as its 'file' field", param="file")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._part.filename is None:
            if len(self._part.data) + end - start > MAX_FIELD_BYTES:
                raise InvalidRequest(f"The form field '{self._part.name[:64]}' is longer than {MAX_FIELD_BYTES} bytes")
            self._part.data += data[start:end]
            return
        self.file_bytes += end - start
        if self.file_bytes > self.max_file_bytes:
            raise PayloadTooLarge(f"The file exceeds the limit of {self.max_file_bytes} bytes", param="file")
        self.pending.append(data[start:end])

    def on_end(self) -> None:
        self.ended = True

    def on_part_end(self) -> None:
        part = self._part
        if part.filename is not None:
            self.form.filename = part.filename or "upload"
            return
        if part.name == "file":
            raise InvalidRequest("The 'file' field must be a file (a part with a filename)", param="file")
        if part.name in self.form.fields:
            raise InvalidRequest(f"The form field '{part.name[:64]}' is given twice", param=part.name[:64])
        value = part.data.decode("utf-8", "replace")
        self.form.fields[part.name] = value
        self.on_field(part.name, value)  # checked as it arrives: a bad purpose refused before the file is read


def _boundary(request: Request) -> bytes:
    content_type, options = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data" or not options.get(b"boundary"):
        raise InvalidRequest("Send the upload as multipart/form-data, with the fields 'file' and 'purpose'")
    return options[b"boundary"]


async def read_form(
    request: Request, stage: Callable[[], Awaitable[Staged]], max_file_bytes: int,
    on_field: Callable[[str, str], None],
) -> Form:
    """The form of an upload, its file staged (the caller stores or discards it, also on error); `on_field` may refuse
    a field by raising."""
    boundary = _boundary(request)
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_file_bytes + _MULTIPART_SLACK:
        raise PayloadTooLarge(f"The upload of {declared} bytes exceeds the limit of {max_file_bytes} bytes", param="file")
    reader = _Reader(max_file_bytes, on_field)
    parser = MultipartParser(boundary, {
        "on_part_begin": reader.on_part_begin, "on_part_data": reader.on_part_data,
        "on_part_end": reader.on_part_end, "on_header_field": reader.on_header_field,
        "on_header_value": reader.on_header_value, "on_header_end": reader.on_header_end,
        "on_headers_finished": reader.on_headers_finished, "on_end": reader.on_end,
    })
    staged = await stage()
    reader.form.file = staged
    try:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                raise ClientDisconnect()
            parser.write(message.get("body", b""))
            if reader.pending:
                await staged.write(b"".join(reader.pending))
                reader.pending.clear()
            if not message.get("more_body", False):
                break
        parser.finalize()
        if not reader.ended:
            raise InvalidRequest("The multipart/form-data body is malformed: it ends before its closing boundary")
        await staged.close()
    except FormParserError as exc:
        await staged.discard()
        raise InvalidRequest("The multipart/form-data body is malformed") from exc
    except BaseException:
        await staged.discard()
        raise
    if not reader.form.filename:
        await staged.discard()
        reader.form.file = None
    return reader.form
