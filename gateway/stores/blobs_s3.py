"""The batch lane's `Blobs` store in an S3-compatible bucket (AWS S3, MinIO, R2...), through boto3 in worker threads;
object `name` of a part is the key `<s3_prefix><part>/<name>`."""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from io import BytesIO
from pathlib import Path
from typing import IO, TYPE_CHECKING, BinaryIO, TypeVar

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from gateway.settings import StoreSettings
from gateway.stores.blobs import BlobsUnavailable, Opened, _read_chunks, check_name

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client
    from mypy_boto3_s3.type_defs import ObjectIdentifierTypeDef

T = TypeVar("T")

APPENDS = "appends"  # the base's metadata naming its generation of parts
CREATED_BY = "created-by"  # metadata of an object made by `create`: a token of that call
PARTS = "~/"  # below the store's root: the parts of appended objects
ATTEMPTS = 3  # requests tried at most (botocore), and reads or appends tried again when raced
PART_READERS = 8  # parts of an appended object fetched at once
MIB = 1024 * 1024
TEMPORARY = "llm-gateway-s3-"  # local temporary files' prefix
Keys = list[str]  # (`list` is also a method of the store)


class _Changed(Exception): ...


@dataclass(slots=True, frozen=True)
class _Head:
    etag: str
    metadata: dict[str, str]

    @property
    def generation(self) -> str | None:
        return self.metadata.get(APPENDS)


def _status(exc: ClientError) -> int:
    return int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0))


def _missing(exc: ClientError) -> bool:
    return _status(exc) == 404 or exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404")


def _client(store: StoreSettings) -> S3Client:
    custom = store.s3_endpoint_url is not None
    config = Config(
        region_name=store.s3_region,
        connect_timeout=store.s3_timeout_s / ATTEMPTS,
        read_timeout=store.s3_timeout_s / ATTEMPTS,
        retries={"total_max_attempts": ATTEMPTS, "mode": "standard"},
        max_pool_connections=32,
        # other services: path-style addressing (no bucket in the host name), checksums only where S3
        # requires them (several S3-compatible services refuse the newer default ones)
        s3={"addressing_style": "path" if custom else "auto"},
        request_checksum_calculation="when_required" if custom else "when_supported",
        response_checksum_validation="when_required" if custom else "when_supported",
    )
    key, secret = store.s3_access_key_id, store.s3_secret_access_key
    return boto3.session.Session().client(
        "s3",
        endpoint_url=store.s3_endpoint_url,
        aws_access_key_id=key.get_secret_value() if key else None,
        aws_secret_access_key=secret.get_secret_value() if secret else None,
        config=config,
    )


@dataclass(slots=True)
class S3Blobs:
    """S3 objects are immutable, so an appended object is a base object carrying a generation (metadata `appends`)
    plus one part object per append, `<part>/~/<name>/~<generation>/<number>` (outside every name's prefix), each
    made with a conditional `create` so two writers cannot write the same part. A read fetches the base, its parts,
    then checks the base's generation again, so it sees one whole version. `create` needs a service honouring
    `If-None-Match: *`."""

    client: S3Client
    bucket: str
    root: str
    transfer: TransferConfig = field(
        default_factory=lambda: TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=8 * MIB,
                                               max_concurrency=4)
    )
    _next: dict[str, tuple[str, int]] = field(default_factory=dict)  # name: its generation, its next part

    @classmethod
    def from_settings(cls, store: StoreSettings, part: str) -> S3Blobs:
        if not store.s3_bucket:
            raise ValueError("store.s3_bucket must be set when store.backend is s3")
        return cls(_client(store), store.s3_bucket, f"{store.s3_prefix}{part}/")

    # keys

    def _key(self, name: str) -> str:
        return self.root + check_name(name)

    def _generations(self, name: str) -> str:
        return f"{self.root}{PARTS}{name}/~"

    def _parts(self, name: str, generation: str) -> str:
        return f"{self._generations(name)}{generation}/"

    # the calls

    async def _run(self, what: str, work: Callable[[], T]) -> T:
        try:
            return await asyncio.to_thread(work)
        except ClientError as exc:
            code = exc.response.get("Error", {}).get("Code", "?")
            raise BlobsUnavailable(f"The S3 store failed to {what} ({code}, HTTP {_status(exc)}).") from exc
        except (BotoCoreError, Boto3Error) as exc:
            raise BlobsUnavailable(f"The S3 store could not {what}: {type(exc).__name__}.") from exc

    async def get(self, name: str) -> bytes | None:
        key, sink = self._key(name), BytesIO()
        found = await self._run("read an object", lambda: self._fetch(name, key, sink))
        return sink.getvalue() if found else None

    async def put(self, name: str, data: bytes) -> None:
        key = self._key(name)
        await self._run("write an object", lambda: self.client.put_object(Bucket=self.bucket, Key=key, Body=data))
        self._forget(name)

    async def create(self, name: str, data: bytes) -> bool:
        key = self._key(name)
        return await self._run("create an object", lambda: self._create(key, data))

    async def put_file(self, name: str, path: Path) -> int:
        key = self._key(name)

        def upload() -> int:
            try:
                size = path.stat().st_size
                self.client.upload_file(str(path), self.bucket, key, Config=self.transfer)
                return size
            finally:
                path.unlink(missing_ok=True)

        size = await self._run("upload a file", upload)
        self._forget(name)
        return size

    async def append(self, name: str, data: bytes) -> None:
        key = self._key(name)
        await self._run("append to an object", lambda: self._append(name, key, data))

    async def open(self, name: str, chunk_bytes: int = 256 * 1024) -> Opened | None:
        key = self._key(name)

        def download() -> BinaryIO | None:
            with contextlib.ExitStack() as closing:
                file = closing.enter_context(tempfile.TemporaryFile(prefix=TEMPORARY))  # nameless: gone when closed
                if not self._fetch(name, key, file):
                    return None
                file.seek(0)
                closing.pop_all()
                return file

        file = await self._run("read an object", download)
        if file is None:
            return None
        return Opened(os.fstat(file.fileno()).st_size, _read_chunks(file, chunk_bytes))

    @contextlib.asynccontextmanager
    async def local(self, name: str) -> AsyncIterator[Path | None]:
        key = self._key(name)

        def download() -> Path | None:
            descriptor, temporary = tempfile.mkstemp(prefix=TEMPORARY)
            path = Path(temporary)
            try:
                with os.fdopen(descriptor, "wb") as file:
                    if self._fetch(name, key, file):
                        return path
            except BaseException:
                path.unlink()
                raise
            path.unlink()
            return None

        path = await self._run("read an object", download)
        try:
            yield path
        finally:
            if path is not None:
                await asyncio.to_thread(path.unlink, missing_ok=True)

    async def copy(self, source: str, target: str) -> bool:
        source_key, target_key = self._key(source), self._key(target)
        copied = await self._run("copy an object", lambda: self._copy(source, source_key, target_key))
        self._forget(target)
        return copied

    async def delete(self, *names: str) -> None:
        keys = [self._key(name) for name in names]

        def remove() -> None:
            self._delete_keys(keys)
            for name in names:  # after the base: a reader of an older generation sees it gone, reads again
                self._delete_keys(self._keys_below(self._generations(name)))

        await self._run("delete objects", remove)
        for name in names:
            self._forget(name)

    async def list(self, prefix: str) -> list[str]:
        directory = prefix.rpartition("/")[0]
        if directory:
            check_name(directory)
        keys = await self._run("list objects", lambda: self._keys_below(self.root + prefix))
        return [name for key in keys if _is_name(name := key[len(self.root):])]

    async def aclose(self) -> None:
        await asyncio.to_thread(self.client.close)

    # blocking work, in a worker thread

    def _create(self, key: str, data: bytes, metadata: dict[str, str] | None = None) -> bool:
        """`data` at `key` unless it exists. A token of this call goes with it: when botocore retried after a lost
        answer, the second try's 412 is recognised as our own write."""
        token = secrets.token_hex(8)
        for _ in range(ATTEMPTS):
            try:
                self.client.put_object(Bucket=self.bucket, Key=key, Body=data, IfNoneMatch="*",
                                       Metadata={**(metadata or {}), CREATED_BY: token})
                return True
            except ClientError as exc:
                if _status(exc) == 412:
                    head = self._head(key)
                    return head is not None and head.metadata.get(CREATED_BY) == token
                if _status(exc) != 409:  # 409: a concurrent conditional write in progress; AWS says try again
                    raise
        raise BlobsUnavailable("The S3 store kept answering a conditional write with a conflict (409).")

    def _head(self, key: str) -> _Head | None:
        try:
            head = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as exc:
            if _missing(exc):
                return None
            raise
        return _Head(head["ETag"], head.get("Metadata", {}))

    def _fetch(self, name: str, key: str, sink: IO[bytes]) -> bool:
        for _ in range(ATTEMPTS):
            sink.seek(0)
            sink.truncate()
            try:
                got = self.client.get_object(Bucket=self.bucket, Key=key)
            except ClientError as exc:
                if _missing(exc):
                    return False
                raise
            for chunk in got["Body"].iter_chunks(MIB):
                sink.write(chunk)
            generation = got.get("Metadata", {}).get(APPENDS)
            if generation is None:
                return True
            try:
                self._fetch_parts(self._keys_below(self._parts(name, generation)), sink)
            except _Changed:
                continue
            head = self._head(key)
            if head is not None and head.generation == generation:  # not replaced meanwhile: those were its parts
                return True
        raise BlobsUnavailable(f"The S3 store's object {name} kept changing while it was read.")

    def _fetch_parts(self, keys: Keys, sink: IO[bytes]) -> None:
        if not keys:
            return
        with ThreadPoolExecutor(PART_READERS, thread_name_prefix="s3-parts") as pool:
            window = PART_READERS * 4
            for start in range(0, len(keys), window):
                for data in pool.map(self._part, keys[start : start + window]):
                    sink.write(data)

    def _part(self, key: str) -> bytes:
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read()
        except ClientError as exc:
            if _missing(exc):
                raise _Changed from exc
            raise

    def _append(self, name: str, key: str, data: bytes) -> None:
        generation = self._generation(name, key)
        parts = self._parts(name, generation)
        for _ in range(ATTEMPTS):
            known = self._next.get(name)
            number = known[1] if known and known[0] == generation else self._last_part(parts) + 1
            if self._create(f"{parts}{number:010d}", data):
                if len(self._next) > 4096:
                    self._next.clear()
                self._next[name] = (generation, number + 1)
                return
            self._next.pop(name, None)  # another writer took that number: count again
        raise BlobsUnavailable(f"The S3 store's object {name} has another writer appending to it.")

    def _generation(self, name: str, key: str) -> str:
        """The generation of `name`'s parts, the base given a new one when it has none."""
        for _ in range(ATTEMPTS):
            head = self._head(key)
            if head is not None and head.generation is not None:
                return head.generation
            generation = secrets.token_hex(8)
            if head is None:
                if not self._create(key, b"", {APPENDS: generation}):
                    continue
            else:
                try:
                    self.client.copy_object(
                        Bucket=self.bucket, Key=key, CopySource={"Bucket": self.bucket, "Key": key},
                        CopySourceIfMatch=head.etag, Metadata={APPENDS: generation}, MetadataDirective="REPLACE",
                    )
                except ClientError as exc:
                    if _missing(exc) or _status(exc) == 412:
                        continue
                    raise
            stale = self._keys_below(self._generations(name))
            self._delete_keys([k for k in stale if not k.startswith(self._parts(name, generation))])
            return generation
        raise BlobsUnavailable(f"The S3 store's object {name} kept changing while it was appended to.")

    def _last_part(self, parts: str) -> int:
        keys = self._keys_below(parts)
        return int(keys[-1][len(parts):]) if keys else 0

    def _copy(self, source: str, source_key: str, target_key: str) -> bool:
        for _ in range(ATTEMPTS):
            head = self._head(source_key)
            if head is None:
                return False
            if head.generation is not None:  # appended: assembled here, uploaded as one object
                with tempfile.TemporaryFile(prefix=TEMPORARY) as file:
                    if not self._fetch(source, source_key, file):
                        return False
                    file.seek(0)
                    self.client.upload_fileobj(file, self.bucket, target_key, Config=self.transfer)
                return True
            try:
                self.client.copy_object(
                    Bucket=self.bucket, Key=target_key, CopySource={"Bucket": self.bucket, "Key": source_key},
                    CopySourceIfMatch=head.etag, MetadataDirective="REPLACE",
                )
                return True
            except ClientError as exc:
                if not (_missing(exc) or _status(exc) == 412):  # gone or replaced since the HEAD: look again
                    raise
        raise BlobsUnavailable(f"The S3 store's object {source} kept changing while it was copied.")

    def _keys_below(self, prefix: str) -> Keys:
        keys: Keys = []
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            keys.extend(item["Key"] for item in page.get("Contents", []))
        return keys

    def _delete_keys(self, keys: Keys) -> None:
        for start in range(0, len(keys), 1000):  # DeleteObjects takes 1,000 keys at most
            batch: Sequence[ObjectIdentifierTypeDef] = [{"Key": key} for key in keys[start : start + 1000]]
            answer = self.client.delete_objects(Bucket=self.bucket, Delete={"Objects": batch, "Quiet": True})
            if errors := answer.get("Errors"):
                raise BlobsUnavailable(f"The S3 store failed to delete objects ({errors[0].get('Code', '?')}).")

    def _forget(self, name: str) -> None:
        self._next.pop(name, None)


def _is_name(name: str) -> bool:
    try:
        check_name(name)
    except ValueError:
        return False
    return True
