"""The batch lane's stores chosen by `store.backend`: records (`stores.batchdb`) and contents (`stores.blobs`).

- disk: SQLite records (`files.dir/files.sqlite3`, `batches.dir/batches.sqlite3`), contents in those directories;
- redis: records in Redis (`redis_url`, for replicas); contents in those directories (a shared volume), or in S3
  when `s3_bucket` is set;
- s3: contents in S3; records in Redis when `redis_url` is set (replicas), else in SQLite (one node)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from gateway.settings import Settings
from gateway.stores.batchdb import Records, RedisRecords, SqliteRecords
from gateway.stores.batches import BatchStore, FileStore
from gateway.stores.blobs import Blobs, LocalBlobs
from gateway.stores.redis import RedisPools

Part = Literal["files", "batches"]


def _blobs(settings: Settings, part: Part, directory: Path) -> Blobs:
    store = settings.store
    if store.backend == "s3" or (store.backend == "redis" and store.s3_bucket):
        try:  # boto3 (the `s3` extra) only where it is used
            from gateway.stores.blobs_s3 import S3Blobs
        except ImportError as exc:
            raise ValueError("S3 blobs need boto3: pip install 'llm-gateway[s3]'") from exc
        return S3Blobs.from_settings(store, part, directory / ".spool")
    return LocalBlobs(directory)


def open_stores(settings: Settings, pools: RedisPools) -> tuple[FileStore, BatchStore]:
    store = settings.store
    files_dir, batches_dir = settings.files.dir.expanduser(), settings.batches.dir.expanduser()
    files: Records
    batches: Records
    if store.redis_url is not None and store.backend != "disk":
        files = batches = RedisRecords(pools.client(store.redis_url, store.redis_timeout_s), store.redis_prefix)
    else:
        files, batches = SqliteRecords(files_dir / "files.sqlite3"), SqliteRecords(batches_dir / "batches.sqlite3")
    return (FileStore(files, _blobs(settings, "files", files_dir)),
            BatchStore(batches, _blobs(settings, "batches", batches_dir)))
