"""What the app holds for its lifetime, handed to handlers as typed lifespan state."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gateway.backends.adapters import AdapterAdmin
from gateway.backends.registry import ModelRegistry
from gateway.guards.guarding import Guards
from gateway.mcp.servers import McpServers
from gateway.pipeline.lifecycle import Lifecycle
from gateway.settings import McpSettings, Settings
from gateway.stores.batches import BatchStore, FileStore
from gateway.stores.cache import ResponseCache
from gateway.stores.responses import ResponseStore
from gateway.stores.streams import StreamStore, in_memory
from gateway.tenancy.keys import Authenticator
from gateway.tenancy.quota import Quota
from gateway.tenancy.tenants import Tenants


class BatchSignals(Protocol):
    """What the routes tell the batch runner (`pipeline.batches.BatchRunner`)."""

    def wake(self) -> None: ...

    def cancel(self, batch_id: str) -> None: ...


class NoRunner:
    """No runner (batches off, or a unit test's state): batches wait in the store."""

    def wake(self) -> None:
        pass

    def cancel(self, batch_id: str) -> None:
        pass


@dataclass(slots=True)
class GatewayState:
    settings: Settings
    models: ModelRegistry
    lifecycle: Lifecycle
    quota: Quota  # rate limits and token budgets per key
    cache: ResponseCache
    guards: Guards
    responses: ResponseStore  # the Responses API's stored responses
    tenants: Tenants  # the keys file: each key's policy
    files: FileStore  # the Files API's uploads, in the batch lane's store (`store.backend`)
    batches: BatchStore  # the Batches API's batches, in the same kind of store
    identities: Authenticator  # who is asking: the API keys (a batch's lines find their creator again)
    batch_runner: BatchSignals = field(default_factory=NoRunner)  # the batch runner, once started
    mcp: McpServers = field(default_factory=lambda: McpServers(McpSettings()))  # the MCP servers file (gateway.mcp)
    streams: StreamStore = field(default_factory=in_memory)  # resumable streams' logs (a unit test's: in memory)
    adapters: AdapterAdmin = field(init=False)  # LoRA adapters loaded and unloaded while serving

    def __post_init__(self) -> None:
        self.adapters = AdapterAdmin(self.models)
