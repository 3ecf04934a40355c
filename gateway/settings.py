"""The gateway's one Settings object, from keyword arguments (the CLI's flags), `GATEWAY_`-prefixed environment
variables (nested with `__`) and a `.env` file, strongest first; built once at the entry point and passed in. And
`Reloadable`: the files it names that are read again in place (TLS, the keys file)."""

from __future__ import annotations

import ipaddress
import os
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import structlog
import yaml
from prometheus_client import Counter
from pydantic import BaseModel, Field, SecretStr, ValidationError, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.config import EngineSettings

Priority = Literal["high", "normal", "low"]  # an API key's priority class (the keys file's `priority`)
Stamp = tuple[tuple[int, int, int] | None, ...]
Block = TypeVar("Block", bound=BaseModel)
log = structlog.get_logger(__name__)


def read_yaml(path: Path, model: type[Block], error: type[ValueError], what: str) -> Block:
    """A YAML file the settings name (the keys file, the MCP servers file) as its model; `error` naming the file and
    the first field that is wrong."""
    try:
        return model.model_validate(yaml.safe_load(path.read_text()) or {})
    except (OSError, yaml.YAMLError) as exc:
        raise error(f"{what} {path}: {exc}") from exc
    except ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        where = ".".join(str(part) for part in first["loc"])
        raise error(f"{what} {path}: {where}: {first['msg']}") from exc


def merged(base: Block, own: BaseModel | Mapping[str, Any] | None) -> Block:
    """`base` (a global block of settings) with what `own` (a model's block of the same kind, or its fields as a
    mapping) names, and nothing else: nested blocks and mappings field by field, every field `own` leaves out
    inherited; validated again as a whole. The one way a per-model block meets its global one."""
    if own is None:
        return base
    named = _named(own) if isinstance(own, BaseModel) else own
    return type(base).model_validate(_over(base.model_dump(), named))


def _named(block: BaseModel) -> dict[str, Any]:
    """The fields a block was given (`model_fields_set`, its nested blocks' too): what it overrides."""
    return {name: _named(value) if isinstance(value, BaseModel) else value
            for name, value in ((name, getattr(block, name)) for name in block.model_fields_set)}


def _over(base: dict[str, Any], own: Mapping[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for name, value in own.items():
        below = out.get(name)
        out[name] = _over(below, value) if isinstance(value, Mapping) and isinstance(below, dict) else value
    return out


class CacheSettings(BaseModel):
    backend: Literal["off", "memory", "redis"] = Field(
        "memory", description="Response cache of deterministic requests: off, in memory, or Redis (shared by replicas)"
    )
    max_entries: int = Field(10_000, gt=0, description="Memory backend: most entries kept (LRU)")
    max_bytes: int = Field(256 * 1024 * 1024, gt=0, description="Memory backend: most bytes kept (LRU)")
    ttl_s: float = Field(3600, gt=0, description="Seconds an answer stays cached")
    store_ttl_s: float = Field(
        30 * 86400, gt=0, description="Seconds a stored response (Responses API) is kept, in the same backend (30 days)"
    )
    redis_url: str | None = Field(None, description="Redis backend: redis://host:port/db")
    redis_prefix: str = Field("llm-gateway:cache:", description="Redis backend: prefix of the cache's keys")
    redis_timeout_s: float = Field(0.5, gt=0, description="Redis backend: give up on a slow Redis after this")
    shared_across_keys: bool = Field(
        False, description="With API keys: one cache for all keys (off: each key sees only its own answers)"
    )


class StreamSettings(BaseModel):
    """Resumable streams (docs/streams.md): every stream's events kept for a client that reconnects, to any replica
    when the stored responses are in Redis (`cache.backend` redis), else in this process."""

    resumable: bool = Field(
        True, description="Keep each stream's events (an x-stream-id header, an SSE id on each event) so that a "
        "client that lost its connection resumes it, on any replica with Redis; off: streams as before, ended by "
        "their client's going"
    )
    grace_s: float = Field(
        30, ge=0, description="A resumable stream whose client left goes on generating this long at most, for a "
        "reconnect to read (the engine's work goes on for nobody meanwhile); 0: it stops at once, as without resuming"
    )
    max_events: int = Field(
        8192, gt=0, description="Events kept per stream (Redis: an approximate MAXLEN); a resume from before them is a 400"
    )
    max_bytes: int = Field(
        2 << 20, gt=0, description="Bytes of events kept per stream (their SSE frames; the oldest dropped first, as "
        "beyond max_events); a resume from before them is a 400"
    )
    ttl_s: float = Field(600, gt=0, description="Seconds a stream's events are kept after its last event")
    max_streams: int = Field(10_000, gt=0, description="In memory (no Redis): streams kept at most, the oldest dropped first")
    memory_bytes: int = Field(
        256 << 20, gt=0, description="In memory (no Redis): bytes of every stream's events and requests kept at most "
        "in this process, the oldest streams dropped first"
    )
    lease_s: float = Field(
        5, gt=0, description="Redis: the producer renews its lease every third of this; a reader that finds it lapsed "
        "without the stream's end takes the producer for dead"
    )
    max_readers: int = Field(
        64, gt=0, description="Resumed streams one API key reads at once on a replica, at most (beyond: 429); each "
        "waits on the log (in Redis: a connection per wait)"
    )
    read_block_s: float = Field(
        1, gt=0, description="A resumed stream's reader waits this long for the next event per read (bounded by "
        "cache.redis_timeout_s in Redis)"
    )


class FairnessSettings(BaseModel):
    """The order in which waiting requests of one priority class are admitted (docs/tenants-and-guards.md,
    Priority classes: fair shares counted in tokens)."""

    order: Literal["vtc", "fcfs"] = Field(
        "vtc",
        description="vtc: the request of the key served least so far goes first (the Virtual Token Counter of "
        "Sheng et al., OSDI 2024: prompt and output tokens, weighted); fcfs: arrival order",
    )
    input_weight: float = Field(1.0, ge=0, description="vtc: what one prompt token counts as service (the paper's: 1)")
    output_weight: float = Field(2.0, ge=0, description="vtc: what one output token counts as service (the paper's: 2)")


class AdmissionSettings(BaseModel):
    """Per model (the models file may override any field, the others inherited): bounds on engine
    requests (each choice of each prompt of a request) running and waiting, and their order."""

    max_running: int = Field(256, gt=0, description="Engine requests generating at once on a model, at most (the adaptive limit's bound)")
    max_waiting: int = Field(1024, ge=0, description="Engine requests queued for a model beyond max_running")
    wait_timeout_s: float = Field(30, gt=0, description="A queued request waits at most this long")
    adaptive: bool = Field(
        True, description="Run as many engine requests at once as the engine's measured pace allows (a gradient "
        "rule, up to max_running); false: max_running, fixed",
    )
    deadline_s: float | None = Field(
        600, gt=0, description="A request's deadline when its client sends no timeout header (X-Stainless-Read-Timeout, "
        "X-Stainless-Timeout, Request-Timeout, X-Request-Timeout): its first byte by then, or it is refused and its "
        "engine request aborted; and a stream's bound on the wait for each next chunk when it sends none of "
        "X-Stainless-Read-Timeout, Request-Timeout, X-Request-Timeout (the measured limit holds the engine's pace well "
        "under it); unset: none",
    )
    reject_status: Literal[429, 503] = Field(429, description="Status of a refused request")
    retry_after_s: int = Field(1, ge=0, description="The least Retry-After sent with a refusal (else the measured time to drain the queue)")
    queue_share: dict[Priority, Annotated[float, Field(ge=0, le=1)]] = Field(
        {"low": 0.5},  # copied per instance by pydantic
        description="The share of max_waiting each priority class (the keys file's `priority`) may fill; "
        "a class not named: 1. Low is refused first as the queue fills; lower normal's to hold room for high",
    )
    key_share: float | None = Field(
        None, gt=0, le=1,
        description="The share of max_running one key may hold while requests of other keys wait (at least one "
        "engine request); unset: no bound per key. Waiting requests of a key at its share are passed over, "
        "in every class, for other keys' requests (with fairness.order vtc, a cap beneath the order)",
    )
    fairness: FairnessSettings = Field(default_factory=FairnessSettings)


class TLSSettings(BaseModel):
    """HTTPS, on when `cert_file` is set. The files are read again, without a restart, on SIGHUP and
    when they change (checked every `reload_interval_s`): new connections get the new certificate."""

    cert_file: Path | None = Field(None, description="PEM certificate chain, the server's first; set: serve HTTPS")
    key_file: Path | None = Field(None, description="PEM private key; unset: it is in cert_file")
    key_password: SecretStr | None = Field(None, description="Password of an encrypted key_file")
    ca_file: Path | None = Field(None, description="PEM CA certificates that client certificates must chain to")
    client_auth: Literal["none", "optional", "required"] = Field(
        "none",
        description="Client certificates (mTLS): none asked; optional: verified when sent; required: "
        "a client without a valid one is refused at the handshake",
    )
    min_version: Literal["TLSv1.2", "TLSv1.3"] = Field("TLSv1.2", description="Oldest TLS version accepted")
    reload_interval_s: float = Field(
        10, ge=0, description="How often the files are checked for a change; 0: reloaded on SIGHUP only"
    )

    @property
    def enabled(self) -> bool:
        return self.cert_file is not None

    @model_validator(mode="after")
    def _complete(self) -> TLSSettings:
        if not self.enabled and (self.key_file or self.ca_file or self.client_auth != "none"):
            raise ValueError("tls: key_file, ca_file and client_auth need tls.cert_file")
        if self.client_auth != "none" and self.ca_file is None:
            raise ValueError(f"tls.client_auth={self.client_auth} needs tls.ca_file to verify clients against")
        return self


class LimitsSettings(BaseModel):
    """Where rate limits and token budgets are counted: in this process, or in Redis (shared by
    every replica; in process again while Redis is down)."""

    redis_url: str | None = Field(None, description="redis://host:port/db shared by the replicas; unset: per process")
    redis_prefix: str = Field("llm-gateway:limits:", description="Prefix of the limits' Redis keys")
    redis_timeout_s: float = Field(0.25, gt=0, description="Give up on a slow Redis after this (then count locally)")
    redis_retry_s: float = Field(5, gt=0, description="After a Redis failure, count locally this long before trying again")


class McpSettings(BaseModel):
    """The Model Context Protocol servers the gateway reaches for its keys (docs/mcp.md): the servers file and the
    bounds of a call to one."""

    servers_file: Path | None = Field(
        None, description="YAML file of MCP servers by label (url, the gateway's own headers for it, allow_private, "
        "timeout_s; docs/mcp.md); read at start. Unset: no servers of the gateway's own (/mcp federates none)",
    )
    timeout_s: float = Field(
        30, gt=0, description="Most seconds one MCP operation (connect, list the tools, call one) may take, unless "
        "the servers file gives the server its own",
    )
    max_output_bytes: int = Field(
        1024 * 1024, gt=0, description="Most bytes of one tool's output kept (beyond: cut, and said so); an MCP "
        "server's answer larger than four times this is refused as a failure",
    )
    # the Responses API's mcp tool (apis.responses.responses_mcp): past either bound the model answers without tools
    max_calls_per_response: int = Field(
        8, gt=0, description="Most MCP tool calls in one response of the Responses API (a request's max_tool_calls "
        "may lower it); past it the model is offered no more tools and answers",
    )
    response_time_s: float = Field(
        120, gt=0, description="Longest one response of the Responses API spends on its MCP turns; past it the "
        "model is offered no more tools and answers",
    )


class TracingSettings(BaseModel):
    """OpenTelemetry traces, exported over OTLP/HTTP; off (no tracing middleware at all) until
    `otlp_endpoint` is set. docs/operations.md, Traces, lists the spans and their attributes."""

    otlp_endpoint: str | None = Field(
        None,
        description="OTLP/HTTP traces endpoint, e.g. http://collector:4318/v1/traces; set: a span per API request, "
        "with the caller's traceparent continued and passed on; unset: tracing off",
    )
    service_name: str = Field("llm-gateway", min_length=1, description="The traces' service.name")
    sample_ratio: float = Field(
        1.0, ge=0, le=1,
        description="Share of new traces kept (by trace id); a caller's traceparent decides for its own requests",
    )
    export_timeout_s: float = Field(10, gt=0, description="Give up on one export of a batch of spans after this")
    engine_spans: bool = Field(
        False,
        description="Also export vLLM's own span per engine request (queue, prefill and decode times) to the same "
        "endpoint, under the gateway's engine span",
    )

    @property
    def enabled(self) -> bool:
        return self.otlp_endpoint is not None

    @model_validator(mode="after")
    def _endpoint_is_http(self) -> TracingSettings:
        endpoint = self.otlp_endpoint
        if endpoint is not None and not endpoint.startswith(("http://", "https://")):
            raise ValueError(f"tracing.otlp_endpoint must be an http:// or https:// URL (OTLP/HTTP), not {endpoint!r}")
        if self.engine_spans and endpoint is None:
            raise ValueError("tracing.engine_spans needs tracing.otlp_endpoint")
        return self


class StructuredOutputSettings(BaseModel):
    """Bounds on what constrains an answer (`response_format` schemas, the parameters of a forced
    tool call): checked before the engine sees them, refused with a 400 naming the field. The size
    limits default to what OpenAI documents for strict structured outputs."""

    max_schema_bytes: int = Field(256 * 1024, gt=0, description="Most bytes of one schema (as compact JSON)")
    max_depth: int = Field(10, gt=0, description="Most levels of nesting (properties, items) in a schema (OpenAI: 10)")
    max_properties: int = Field(5000, gt=0, description="Most object properties in a schema, all objects together (OpenAI: 5000)")
    max_enum_values: int = Field(1000, gt=0, description="Most enum values in a schema, all enums together (OpenAI: 1000)")
    max_string_chars: int = Field(
        120_000, gt=0,
        description="Most characters of property names, definition names, enum and const strings together (OpenAI: 120,000)",
    )
    max_alternatives: int = Field(
        1000, gt=0, description="Most anyOf, oneOf and allOf branches in a schema, all together"
    )
    compile_timeout_s: float = Field(
        2.0, gt=0, description="A schema the engine's grammar compiler (xgrammar) cannot compile within this is "
        "refused (400), so that one huge schema does not hold back every other one",
    )
    compile_wait_s: float = Field(
        10, gt=0, description="Longest wait for a free compiler process (all busy with new schemas); beyond: 503"
    )
    compile_workers: int = Field(
        2, ge=0, description="Processes per model that compile new schemas before the engine does (each loads "
        "xgrammar, torch and the tokenizer); 0: no compile check (the size limits still hold)",
    )
    compile_verdicts: int = Field(4096, gt=0, description="Compile verdicts kept per model (by schema hash), least recently used out")


class FilesSettings(BaseModel):
    """The Files API (`/v1/files`): uploads kept in the batch lane's store (`store`: local disk by
    default), each file a record of its owner's and a content written once. Files are the first part
    of the batch lane: a `batch` file is checked, line by line, as batch input."""

    dir: Path = Field(
        "~/.local/state/llm-gateway/files",  # made a Path by validate_default
        validate_default=True,
        description="Where files are kept: their records in files.sqlite3 (store.backend disk, or s3 without "
        "redis_url) and their contents (unless in S3); with every backend, uploads are received in its .spool",
    )
    max_bytes: int = Field(
        200 * 1024 * 1024, gt=0,
        description="Largest file one upload may carry (OpenAI's limit on batch input: 200 MB); streamed to disk, "
        "never held in memory; larger: 413",
    )
    max_lines: int = Field(50_000, gt=0, description="Most requests (lines) in a batch file (OpenAI's limit: 50,000)")
    max_line_bytes: int = Field(
        4 * 1024 * 1024, gt=0, description="Longest line of a batch file (one request, as a request body would be)"
    )
    upload_timeout_s: float = Field(
        600, gt=0,
        description="An upload's body must arrive within this (else 408), in place of body_timeout_s; its bytes go to "
        "disk and do not count in max_body_bytes_in_flight",
    )
    expires_after_s: int = Field(
        30 * 86400, ge=3600, le=30 * 86400,
        description="A file expires this long after its upload unless the upload asks otherwise (expires_after; "
        "OpenAI's default for batch files: 30 days)",
    )


class StoreSettings(BaseModel):
    """Where the batch lane keeps its files and batches: records (files, batches, their counts, each line's answer) in a
    database, and contents (uploads, inputs, output files) written once each. disk: SQLite files under `files.dir` and
    `batches.dir`, contents beside them (one node). redis: records in Redis (replicas), contents in those directories (a
    shared volume) or in S3 when `s3_bucket` is set. s3: contents in S3, records in Redis when `redis_url` is set, else
    SQLite. Replicas that share batches share this store; a batch runs on one of them at a time (a claim with a fencing
    token)."""

    backend: Literal["disk", "redis", "s3"] = Field(
        "disk", description="disk (SQLite and files in files.dir, batches.dir), redis (records at redis_url) or s3 "
        "(contents in s3_bucket at s3_endpoint_url)"
    )
    redis_url: str | None = Field(None, description="Records in Redis (backend redis, or s3): redis://host:port/db "
                                  "(persistence on: AOF)")
    redis_prefix: str = Field("llm-gateway:store:", description="Redis backend: prefix of the store's keys")
    redis_timeout_s: float = Field(10, gt=0, description="Redis backend: a call gives up after this (a 503)")
    s3_endpoint_url: str | None = Field(
        None, description="S3 backend: the service's URL (unset: AWS S3 of s3_region); MinIO, Ceph, R2 and others"
    )
    s3_bucket: str | None = Field(None, description="Contents in S3 (backend s3, or redis): the bucket (it must exist)")
    s3_prefix: str = Field("llm-gateway/", description="S3 backend: prefix of the store's object keys")
    s3_region: str = Field("us-east-1", description="S3 backend: the region")
    s3_access_key_id: SecretStr | None = Field(
        None, description="S3 backend: the access key (unset: the usual AWS_* variables, profile or role)"
    )
    s3_secret_access_key: SecretStr | None = Field(None, description="S3 backend: the secret key")
    s3_timeout_s: float = Field(30, gt=0, description="S3 backend: a call gives up after this (a 503)")

    @model_validator(mode="after")
    def _complete(self) -> StoreSettings:
        if self.backend == "redis" and not self.redis_url:
            raise ValueError("store.backend redis needs store.redis_url (redis://host:port/db)")
        if self.backend == "s3" and not self.s3_bucket:
            raise ValueError("store.backend s3 needs store.s3_bucket (an existing bucket)")
        if (self.s3_access_key_id is None) != (self.s3_secret_access_key is None):
            raise ValueError("store.s3_access_key_id and store.s3_secret_access_key go together (or neither: "
                             "boto3's usual credentials)")
        return self


class BatchesSettings(BaseModel):
    """The Batches API (`/v1/batches`): batches of a key's uploaded requests run by this gateway's own
    models at the lowest priority, their records and answers in the batch lane's store (`store`:
    SQLite and local disk by default), resumed after a restart."""

    enabled: bool = Field(
        True, description="Run batches on this replica (the embedded engines then schedule by priority when their "
        "scheduling_policy is auto); off: /v1/batches still creates and answers them, a replica with it on runs them",
    )
    dir: Path = Field(
        "~/.local/state/llm-gateway/batches",  # made a Path by validate_default
        validate_default=True,
        description="Where batches are kept: their records and answers in batches.sqlite3 (store.backend disk, or "
        "s3 without redis_url) and their inputs (unless in S3); with every backend, contents are staged in its .spool",
    )
    max_in_flight: int = Field(
        4, gt=0, description="Batch lines this replica runs at once, across all batches (each at the lowest priority)",
    )
    lease_s: float = Field(
        30, gt=0, description="A replica running a batch holds its claim this long, renewed every third of it; "
        "another replica claims the batch only once the claim has lapsed, and the first one's writes are refused then",
    )
    poll_s: float = Field(
        1, gt=0, description="How often the runner looks for batches to run (created on other replicas, claims "
        "lapsed) and a running batch for a cancel from another replica",
    )
    retry_s: float = Field(
        5, gt=0, description="A line refused by the key's rate limits (requests or tokens per minute) waits this "
        "long, at least, before it is tried again",
    )
    output_expires_after_s: int = Field(
        30 * 86400, ge=3600, le=30 * 86400,
        description="A batch's output and error files expire this long after they are written, unless the batch "
        "asks otherwise (output_expires_after)",
    )


class Settings(BaseSettings):
    """The gateway's own settings: its HTTP server, logs, request bounds, API keys and the files it reads."""

    model_config = SettingsConfigDict(
        env_prefix="GATEWAY_",
        env_nested_delimiter="__",
        env_file=".env",
        extra="ignore",
    )

    host: str = Field("127.0.0.1", description="Address to listen on")
    port: int = Field(8000, ge=0, le=65535, description="Port to listen on")
    workers: int = Field(
        1, ge=1, le=64,
        description="Gateway processes serving the one listening socket, each embedded model's engine core shared "
        "by all (docs/deployment.md, Workers); 1: one process, as before. Above 1, rate limits need limits.redis_url",
    )
    log_level: Literal["debug", "info", "warning", "error"] = Field(
        "info", description="Lowest level of the gateway's log lines (vLLM's follow unless engine.log_level says)"
    )
    log_format: Literal["console", "json"] = Field(
        "console", description="console: readable lines for development; json: one JSON object a line"
    )
    log_prompts: bool = Field(
        False, description="Put prompts and outputs in the access log (they may hold personal data)"
    )
    max_body_bytes: int = Field(4 * 1024 * 1024, gt=0, description="Larger request bodies get 413")
    default_max_tokens: int | None = Field(
        None,
        description="max_tokens when a chat request sends none and the model has no default (docs/models.md, "
        "Sampling defaults); unset: what the context leaves",
    )
    warmup: bool = Field(
        True, description="Before serving, run one structured-output request so that xgrammar's one-time set-up "
        "is not paid by the first client asking for JSON",
    )
    freeze_startup_heap: bool = Field(
        True, description="Once started, move the start-up heap out of the garbage collector's passes (gc.freeze, "
        "as vLLM's server does): full collections then walk only what requests allocate (benchmarks/RESULTS.md)",
    )
    gc_young_threshold: int = Field(
        10_000, ge=0, description="While serving: allocations between the garbage collector's passes over the "
        "youngest objects (Python's default 700; 0 leaves it): requests free nearly all they allocate by reference "
        "count, so frequent passes mostly walked the objects in flight again (benchmarks/RESULTS.md)",
    )
    drain_timeout_s: float = Field(
        30, ge=0, description="On SIGTERM: how long in-flight requests may finish before the engines stop"
    )
    api_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Bearer API keys (JSON list); empty: no auth. Kept only as SHA-256 hashes",
    )
    admin_keys: list[SecretStr] = Field(
        default_factory=list,
        description="Bearer keys of the admin API (loading and unloading LoRA adapters; JSON list), never valid "
        "on the other routes, as API keys are not on the admin API; empty: the admin API answers 404",
    )
    auth_ops_routes: bool = Field(False, description="Require a key on /health, /ready and /metrics too")
    rate_limit_rpm: int | None = Field(None, gt=0, description="Requests per minute per API key")
    rate_limit_tpm: int | None = Field(
        None, gt=0, description="Tokens (prompt + max output, counted up front as OpenAI does) per minute per API key"
    )
    auth_failures_per_minute: int = Field(
        10, gt=0,
        description="Unknown API keys per client address per minute; more are refused 429 (a known key never is)",
    )
    forwarded_allow_ips: str = Field(
        "",
        description="Trusted proxies (comma-separated addresses or networks such as 10.0.0.0/8, or *) whose "
        "forwarded header names the client address; empty: none, the peer is the client",
    )
    forwarded_header: Literal["x-forwarded-for", "forwarded"] = Field(
        "x-forwarded-for",
        description="The header trusted proxies name the client in: X-Forwarded-For, or RFC 7239 Forwarded",
    )
    key_id_secret: SecretStr | None = Field(
        None, description="Secret of the keyed hash that names API keys in logs, limits and budgets; unset: a random "
        "one per process (per server: its workers share one); replicas sharing Redis limits need the same one"
    )
    max_prompts_per_request: int = Field(256, gt=0, description="Most prompts in one completions request")
    max_output_tokens_per_request: int = Field(
        262_144, gt=0, description="Most output tokens one request may ask for: prompts x n (or best_of) x max_tokens"
    )
    max_body_bytes_in_flight: int = Field(
        64 * 1024 * 1024, gt=0,
        description="Request bodies being read and prepared (tokenized), all requests together; beyond: 503 "
        "with Retry-After",
    )
    header_timeout_s: float = Field(10, gt=0, description="A client must send a request's headers within this")
    body_timeout_s: float = Field(60, gt=0, description="A client must send a request's body within this (else 408)")
    stream_write_timeout_s: float = Field(
        60, gt=0, description="A stream whose client reads nothing for this long (its send waits) is ended as a "
        "disconnect: its engine request aborted, its admission slot given back"
    )
    keep_alive_timeout_s: int = Field(
        5, gt=0, description="An idle connection (a kept-alive one, or a new one that sends nothing) is closed after this"
    )
    max_request_headers: int = Field(100, gt=0, description="Most headers one request may carry (else 431)")
    max_request_header_bytes: int = Field(
        32 * 1024, gt=0, le=64 * 1024,
        description="Most bytes of headers one request may carry (else 431; past 64 KiB the connection is closed)",
    )
    max_connections: int = Field(
        2048, gt=0, description="Connections (and requests in progress) at once; beyond, new requests get 503"
    )
    keys_file: Path | None = Field(
        None,
        description="YAML file of API keys with their own settings (models, limits, budgets, guards, priority, "
        "team; docs/tenants-and-guards.md); read again on SIGHUP and when it changes",
    )
    keys_reload_interval_s: float = Field(
        10, ge=0, description="How often the keys file is checked for a change; 0: reloaded on SIGHUP only"
    )
    limits: LimitsSettings = Field(default_factory=LimitsSettings)
    models_file: Path | None = Field(
        None,
        description="YAML or TOML file declaring several models (embedded, remote, A/B splits, fallbacks; "
        "docs/models.md); unset: the one model of the engine settings",
    )
    tls: TLSSettings = Field(default_factory=TLSSettings)
    guards_file: Path | None = Field(
        None,
        description="YAML or TOML file of guard profiles (prompt and output checks) and who gets which "
        "(docs/tenants-and-guards.md); unset: no guards but the models file's inline ones",
    )
    embedding_model: str | None = Field(
        None,
        description="Without a models file: also serve the engine's model as an embedding model under this name "
        "(vLLM's pooling runner; a second engine); unset: none",
    )
    cache: CacheSettings = Field(default_factory=CacheSettings)
    streams: StreamSettings = Field(default_factory=StreamSettings)
    files: FilesSettings = Field(default_factory=FilesSettings)
    batches: BatchesSettings = Field(default_factory=BatchesSettings)
    store: StoreSettings = Field(default_factory=StoreSettings)
    tracing: TracingSettings = Field(default_factory=TracingSettings)
    mcp: McpSettings = Field(default_factory=McpSettings)
    admission: AdmissionSettings = Field(default_factory=AdmissionSettings)
    structured_output: StructuredOutputSettings = Field(default_factory=StructuredOutputSettings)
    engine: EngineSettings = Field(default_factory=EngineSettings)

    @model_validator(mode="after")
    def _coherent(self) -> Settings:
        if self.max_body_bytes_in_flight < self.max_body_bytes:
            raise ValueError("max_body_bytes_in_flight must be at least max_body_bytes")
        if self.workers > 1 and self.limits.redis_url is None and (self.rate_limit_rpm or self.rate_limit_tpm):
            raise ValueError(
                "workers > 1 with rate_limit_rpm or rate_limit_tpm needs limits.redis_url "
                "(counted in each worker's memory, every worker would allow the whole limit)"
            )
        api = {key.get_secret_value() for key in self.api_keys}
        if any(key.get_secret_value() in api for key in self.admin_keys):
            raise ValueError("an admin key (admin_keys) is also an API key (api_keys): give admins keys of their own")
        for entry in self.forwarded_allow_ips.split(","):
            if entry.strip() not in ("", "*"):
                ipaddress.ip_network(entry.strip(), strict=False)  # ValueError: "... does not appear to be ..."
        return self

    @model_validator(mode="after")
    def _engine_follows(self) -> Settings:
        """vLLM's own log lines take the gateway's format and level, and its spans the gateway's endpoint, unless
        `engine` says otherwise."""
        if self.engine.log_format is None:
            self.engine.log_format = "json" if self.log_format == "json" else "text"
        if self.engine.log_level is None:
            self.engine.log_level = self.log_level
        if self.tracing.engine_spans and self.engine.otlp_traces_endpoint is None:
            self.engine.otlp_traces_endpoint = self.tracing.otlp_endpoint
        return self


class Reloadable:
    """Files read again in place: on SIGHUP (`reload`) and, every `interval_s`, when one changed (`poll`: by mtime,
    size and inode, as a mounted Secret or ConfigMap swaps a symlink). A version `apply` refuses (OSError,
    ValueError) is logged and counted once, and the one in service stays."""

    what = "files"  # the log events' prefix: `<what>_reloaded`, `<what>_reload_failed`

    def __init__(self, files: list[Path], interval_s: float, reloads: Counter) -> None:
        self.files, self.interval_s, self._reloads = files, interval_s, reloads
        self._stamp = self._stamp_now()
        self._refused: Stamp | None = None
        self._next_poll = time.monotonic() + interval_s

    def apply(self) -> dict[str, Any]:
        """The files read and put in service: what the log line says of them."""
        raise NotImplementedError

    def reload(self, reason: str) -> bool:
        if not self.files:
            return False
        stamp = self._stamp_now()
        try:
            fields = self.apply()
        except (OSError, ValueError) as exc:  # ssl.SSLError is an OSError
            self._refused = stamp
            self._reloads.labels(result="error").inc()
            log.error(f"{self.what}_reload_failed", reason=reason, error=str(exc), files=[str(f) for f in self.files])
            return False
        self._stamp, self._refused = stamp, None
        self._reloads.labels(result="ok").inc()
        log.info(f"{self.what}_reloaded", reason=reason, **fields)
        return True

    def poll(self) -> None:
        now = time.monotonic()
        if not self.files or self.interval_s <= 0 or now < self._next_poll:
            return
        self._next_poll = now + self.interval_s
        stamp = self._stamp_now()
        if stamp != self._stamp and stamp != self._refused:
            self.reload("files changed")

    def _stamp_now(self) -> Stamp:
        stamps: list[tuple[int, int, int] | None] = []
        for path in self.files:
            try:
                st = os.stat(path)
            except OSError:
                stamps.append(None)
            else:
                stamps.append((st.st_mtime_ns, st.st_size, st.st_ino))
        return tuple(stamps)
