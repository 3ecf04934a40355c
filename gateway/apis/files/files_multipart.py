"""A `multipart/form-data` upload read as it arrives by python-multipart, its one file part written chunk by chunk to
the store's local spool (Starlette's parser would spool it to a temporary directory first), bounded in parts, field
size and file size."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from python_multipart.exceptions import FormParserError
from python_multipart.multipart import MultipartParser, parse_options_header
from starlette.requests import Request

from gateway.errors import InvalidRequest, PayloadTooLarge
from gateway.stores.blobs import Staged

MAX_PARTS = 16
MAX_FIELD_BYTES = 1024
MAX_FILENAME_CHARS = 255
_MULTIPART_SLACK = 64 * 1024  # the boundaries, part headers and small fields around the file


class Form:
    """An upload's form as python-multipart's callbacks parse it: its fields (each checked by `on_field` as it
    arrives), its one file (`file`, staged by the caller; `filename` empty until one came whole)."""

    def __init__(self, max_file_bytes: int, on_field: Callable[[str, str], None]) -> None:
        self.fields: dict[str, str] = {}
        self.file: Staged | None = None
        self.filename = ""
        self.max_file_bytes, self.on_field = max_file_bytes, on_field
        self.pending: list[bytes] = []  # file bytes parsed from the last chunk, to write
        self.file_bytes = self.parts = 0
        self.ended = False  # the closing boundary was read (a body cut short has none)
        self._name, self._data = "", bytearray()  # the part being read
        self._filename: str | None = None
        self._header_name, self._header_value = bytearray(), bytearray()

    def on_part_begin(self) -> None:
        self.parts += 1
        if self.parts > MAX_PARTS:
            raise InvalidRequest(f"The form has more than {MAX_PARTS} parts")
        self._name, self._filename, self._data = "", None, bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_name += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]  # bounded by the parser (`max_header_size`)

    def on_header_end(self) -> None:
        if bytes(self._header_name).lower() == b"content-disposition":
            _, options = parse_options_header(bytes(self._header_value))
            self._name = options.get(b"name", b"").decode("utf-8", "replace")
            raw_filename = options.get(b"filename")
            if raw_filename is not None:
                self._filename = raw_filename.decode("utf-8", "replace")[-MAX_FILENAME_CHARS:]
        self._header_name.clear()
        self._header_value.clear()

    def on_headers_finished(self) -> None:
        if not self._name:
            raise InvalidRequest("A part of the form has no name (Content-Disposition: form-data; name=...)")
        if self._filename is not None and (self._name != "file" or self.filename):
            raise InvalidRequest("The form must carry exactly one file, as its 'file' field", param="file")

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        if self._filename is None:
            if len(self._data) + end - start > MAX_FIELD_BYTES:
                raise InvalidRequest(f"The form field '{self._name[:64]}' is longer than {MAX_FIELD_BYTES} bytes")
            self._data += data[start:end]
            return
        self.file_bytes += end - start
        if self.file_bytes > self.max_file_bytes:
            raise PayloadTooLarge(f"The file exceeds the limit of {self.max_file_bytes} bytes", param="file")
        self.pending.append(data[start:end])

    def on_end(self) -> None:
        self.ended = True

    def on_part_end(self) -> None:
        name = self._name
        if self._filename is not None:
            self.filename = self._filename or "upload"
            return
        if name == "file":
            raise InvalidRequest("The 'file' field must be a file (a part with a filename)", param="file")
        if name in self.fields:
            raise InvalidRequest(f"The form field '{name[:64]}' is given twice", param=name[:64])
        value = self._data.decode("utf-8", "replace")
        self.fields[name] = value
        self.on_field(name, value)  # checked as it arrives: a bad purpose refused before the file is read


async def read_form(request: Request, stage: Callable[[], Awaitable[Staged]], max_file_bytes: int,
                    on_field: Callable[[str, str], None]) -> Form:
    """The form of an upload, its file staged (the caller stores or discards it, also on error); `on_field` may refuse
    a field by raising."""
    content_type, options = parse_options_header(request.headers.get("content-type"))
    if content_type != b"multipart/form-data" or not options.get(b"boundary"):
        raise InvalidRequest("Send the upload as multipart/form-data, with the fields 'file' and 'purpose'")
    declared = request.headers.get("content-length", "")
    if declared.isascii() and declared.isdigit() and int(declared) > max_file_bytes + _MULTIPART_SLACK:
        raise PayloadTooLarge(f"The upload of {declared} bytes exceeds the limit of {max_file_bytes} bytes", param="file")
    form = Form(max_file_bytes, on_field)
    parser = MultipartParser(options[b"boundary"], {
        "on_part_begin": form.on_part_begin, "on_part_data": form.on_part_data, "on_part_end": form.on_part_end,
        "on_header_field": form.on_header_field, "on_header_value": form.on_header_value,
        "on_header_end": form.on_header_end, "on_headers_finished": form.on_headers_finished, "on_end": form.on_end,
    }, max_header_size=MAX_FIELD_BYTES)
    staged = form.file = await stage()
    try:
        async for chunk in request.stream():  # a client gone: `ClientDisconnect`
            parser.write(chunk)
            if form.pending:
                await staged.write(b"".join(form.pending))
                form.pending.clear()
        parser.finalize()
        if not form.ended:
            raise InvalidRequest("The multipart/form-data body is malformed: it ends before its closing boundary")
        await staged.close()
    except BaseException as exc:
        await staged.discard()
        if isinstance(exc, FormParserError):
            raise InvalidRequest("The multipart/form-data body is malformed") from exc
        raise
    if not form.filename:
        await staged.discard()
        form.file = None
    return form
