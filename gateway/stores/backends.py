"""The batch lane's `Blobs` store chosen by `store.backend`, one for files and one for batches."""

from __future__ import annotations

from typing import Literal

from gateway.settings import Settings
from gateway.stores.blobs import Blobs, DiskBlobs
from gateway.stores.blobs_redis import RedisBlobs
from gateway.stores.redis import RedisPools

Part = Literal["files", "batches"]


def open_blobs(settings: Settings, pools: RedisPools, part: Part) -> Blobs:
    store = settings.store
    if store.backend == "disk":
        return DiskBlobs.at(settings.files.dir if part == "files" else settings.batches.dir)
    if store.backend == "redis" and store.redis_url is not None:  # the URL: checked by StoreSettings
        return RedisBlobs(pools.client(store.redis_url, store.redis_timeout_s), f"{store.redis_prefix}{part}:")
    if store.backend == "s3":
        try:  # boto3 (the `s3` extra) only where it is used
            from gateway.stores.blobs_s3 import S3Blobs
        except ImportError as exc:
            raise ValueError("store.backend s3 needs boto3: pip install 'llm-gateway[s3]'") from exc
        return S3Blobs.from_settings(store, part)
    raise NotImplementedError(f"store.backend {store.backend} is not built yet")
