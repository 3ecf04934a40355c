"""The batch lane's contents in an S3-compatible bucket (AWS S3, MinIO, R2...), through boto3 in worker threads; blob
`name` of a part is the key `<s3_prefix><part>/<name>`. Each content is one upload (multipart when large) and never
changed after: no conditional writes, no appends."""

from __future__ import annotations

import asyncio
import contextlib
import os
import tempfile
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

import boto3
from boto3.exceptions import Boto3Error
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from gateway.settings import StoreSettings
from gateway.stores.blobs import check_name, unavailable

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

T = TypeVar("T")
ATTEMPTS = 3  # requests tried at most (botocore)
MIB = 1024 * 1024
ERRORS = (ClientError, BotoCoreError, Boto3Error)  # a service down, slow or refusing: the API's 503
TRANSFER = TransferConfig(multipart_threshold=8 * MIB, multipart_chunksize=8 * MIB, max_concurrency=4)


def _missing(exc: ClientError) -> bool:
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return status == 404 or exc.response.get("Error", {}).get("Code") in ("NoSuchKey", "404")


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
    client: S3Client
    bucket: str
    root: str
    spool: Path

    @classmethod
    def from_settings(cls, store: StoreSettings, part: str, spool: Path) -> S3Blobs:
        if not store.s3_bucket:
            raise ValueError("store.s3_bucket must be set when store.backend is s3")
        return cls(_client(store), store.s3_bucket, f"{store.s3_prefix}{part}/", spool)

    def _key(self, name: str) -> str:
        return self.root + check_name(name)

    async def _run(self, work: Callable[[], T]) -> T:
        with unavailable(*ERRORS):
            return await asyncio.to_thread(work)

    async def put_file(self, name: str, path: Path) -> None:
        key = self._key(name)

        def upload() -> None:
            try:
                self.client.upload_file(str(path), self.bucket, key, Config=TRANSFER)
            finally:
                path.unlink(missing_ok=True)

        await self._run(upload)

    @contextlib.asynccontextmanager
    async def local(self, name: str) -> AsyncIterator[Path | None]:
        key = self._key(name)

        def download() -> Path | None:
            descriptor, temporary = tempfile.mkstemp(prefix="llm-gateway-s3-")
            os.close(descriptor)
            try:
                self.client.download_file(self.bucket, key, temporary, Config=TRANSFER)
                return Path(temporary)
            except BaseException as exc:
                os.unlink(temporary)
                if isinstance(exc, ClientError) and _missing(exc):
                    return None
                raise

        path = await self._run(download)
        try:
            yield path
        finally:
            if path is not None:
                await asyncio.to_thread(path.unlink, missing_ok=True)

    async def delete(self, *names: str) -> None:
        keys = [self._key(name) for name in names]

        def remove() -> None:
            for key in keys:
                self.client.delete_object(Bucket=self.bucket, Key=key)

        await self._run(remove)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.client.close)
