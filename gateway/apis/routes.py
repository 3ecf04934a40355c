"""The one route table (`TABLE`): every path the gateway serves, once, with its access class (`api`, `ops`, `open`,
`admin`); every layer reads its routes from here (tests/unit/test_routes.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.apis.admin import admin_routes
from gateway.apis.admin import admin_wire as ad
from gateway.apis.batches import batches_routes, batches_wire
from gateway.apis.chat.chat_serving import CHAT
from gateway.apis.completions.completions_serving import COMPLETIONS
from gateway.apis.conversations import conversations_routes, conversations_wire
from gateway.apis.embeddings import embeddings_wire
from gateway.apis.embeddings.embeddings_serving import EMBEDDINGS
from gateway.apis.files import files_routes, files_wire
from gateway.apis.mcp import mcp_routes
from gateway.apis.message_batches import message_batches_routes
from gateway.apis.message_batches import message_batches_wire as mb
from gateway.apis.messages import messages_routes
from gateway.apis.messages import messages_wire as a
from gateway.apis.models import models_routes
from gateway.apis.native import native_routes, native_wire
from gateway.apis.openapi import document
from gateway.apis.ops import ops_routes
from gateway.apis.responses import responses_routes, responses_wire
from gateway.protocol import batch_objects as b
from gateway.protocol import embeddings as e
from gateway.protocol import openai as p
from gateway.protocol import response_objects as r
from gateway.web.answers import resuming, served
from gateway.web.table import Endpoint, RouteTable


async def openapi(request: Request) -> Response:
    return JSONResponse(document(TABLE.endpoints))


TABLE = RouteTable([
    Endpoint("POST", "/v1/chat/completions", served(p.ChatCompletionRequest, CHAT), "api", "Create a chat completion",
             p.ChatCompletionRequest, p.ChatCompletion, streams=True),
    Endpoint("GET", "/v1/chat/completions/streams/{stream_id}", resuming("/v1/chat/completions"), "api",
             "Resume a chat completion's stream after its Last-Event-ID, on any replica (SSE)"),
    Endpoint("POST", "/v1/completions", served(p.CompletionRequest, COMPLETIONS), "api", "Create a completion",
             p.CompletionRequest, p.Completion, streams=True),
    Endpoint("GET", "/v1/completions/streams/{stream_id}", resuming("/v1/completions"), "api",
             "Resume a completion's stream after its Last-Event-ID, on any replica (SSE)"),
    Endpoint("POST", "/v1/embeddings", served(e.EmbeddingRequest, EMBEDDINGS), "api", "Create embeddings",
             e.EmbeddingRequest, embeddings_wire.CreateEmbeddingResponse),
    Endpoint("POST", "/v1/messages", messages_routes.create, "api", "Create a message (Anthropic's Messages API)",
             a.MessagesRequest, a.Message, streams=True, dialect="anthropic"),
    Endpoint("GET", "/v1/messages/streams/{stream_id}", resuming("/v1/messages"), "api",
             "Resume a message's stream after its Last-Event-ID, on any replica (SSE)", dialect="anthropic"),
    Endpoint("POST", "/v1/messages/count_tokens", messages_routes.count_tokens, "api", "Count a message's input tokens "
             "(Anthropic's API)", a.CountTokensRequest, a.MessageTokensCount, dialect="anthropic"),
    Endpoint("POST", "/v1/messages/batches", message_batches_routes.create, "api", "Create a Message Batch "
             "(Anthropic's API)", mb.MessageBatchCreate, mb.MessageBatch, dialect="anthropic"),
    Endpoint("GET", "/v1/messages/batches", message_batches_routes.list_batches, "api", "List the key's Message Batches, "
             "newest first (Anthropic's API)", None, mb.MessageBatchList, dialect="anthropic"),
    Endpoint("GET", "/v1/messages/batches/{message_batch_id}", message_batches_routes.retrieve, "api",
             "Retrieve a Message Batch (Anthropic's API)", None, mb.MessageBatch, dialect="anthropic"),
    Endpoint("DELETE", "/v1/messages/batches/{message_batch_id}", message_batches_routes.delete, "api",
             "Delete a Message Batch that has ended (Anthropic's API)", None, mb.DeletedMessageBatch,
             dialect="anthropic"),
    Endpoint("POST", "/v1/messages/batches/{message_batch_id}/cancel", message_batches_routes.cancel, "api",
             "Cancel a Message Batch (Anthropic's API)", None, mb.MessageBatch, dialect="anthropic"),
    Endpoint("GET", "/v1/messages/batches/{message_batch_id}/results", message_batches_routes.results, "api",
             "A Message Batch's results, one JSON line per request (Anthropic's API)", dialect="anthropic"),
    Endpoint("GET", "/v1/models", models_routes.list_models, "api", "List the served models", None, p.ModelList),
    Endpoint("GET", "/v1/models/{model:path}", models_routes.retrieve_model, "api", "Retrieve a served model",
             None, p.ModelCard),
    Endpoint("POST", "/v1/responses", responses_routes.create, "api", "Create a model response (Responses API)",
             responses_wire.ResponsesRequest, r.Response, streams=True),
    Endpoint("GET", "/v1/responses/{response_id}", responses_routes.by_id, "api", "Retrieve a stored response", None,
             r.Response),
    Endpoint("DELETE", "/v1/responses/{response_id}", responses_routes.by_id, "api", "Delete a stored response",
             None, responses_wire.ResponseDeleted),
    Endpoint("GET", "/v1/responses/{response_id}/input_items", responses_routes.input_items, "api",
             "List the items a response took as input", None, responses_wire.ResponseItemList),
    Endpoint("POST", "/v1/responses/{response_id}/cancel", responses_routes.cancel, "api",
             "Cancel a background response",
             None, r.Response),
    Endpoint("POST", "/v1/conversations", conversations_routes.create, "api", "Create a conversation",
             conversations_wire.ConversationCreate, conversations_wire.Conversation),
    Endpoint("GET", "/v1/conversations/{conversation_id}", conversations_routes.retrieve, "api", "Retrieve a conversation",
             None, conversations_wire.Conversation),
    Endpoint("POST", "/v1/conversations/{conversation_id}", conversations_routes.update, "api",
             "Update a conversation's metadata", conversations_wire.ConversationUpdate, conversations_wire.Conversation),
    Endpoint("DELETE", "/v1/conversations/{conversation_id}", conversations_routes.delete, "api",
             "Delete a conversation", None, conversations_wire.ConversationDeleted),
    Endpoint("GET", "/v1/conversations/{conversation_id}/items", conversations_routes.list_items, "api",
             "List a conversation's items", None, responses_wire.ResponseItemList),
    Endpoint("POST", "/v1/conversations/{conversation_id}/items", conversations_routes.add_items, "api",
             "Add items to a conversation", conversations_wire.ItemsCreate, responses_wire.ResponseItemList),
    Endpoint("GET", "/v1/conversations/{conversation_id}/items/{item_id}", conversations_routes.item, "api",
             "Retrieve a conversation's item"),
    Endpoint("DELETE", "/v1/conversations/{conversation_id}/items/{item_id}", conversations_routes.delete_item, "api",
             "Delete a conversation's item", None, conversations_wire.Conversation),
    Endpoint("POST", "/v1/files", files_routes.upload, "api",
             "Upload a file (multipart/form-data: file, purpose batch)",
             None, b.FileObject, upload=True),
    Endpoint("GET", "/v1/files", files_routes.list_files, "api", "List the key's files", None, files_wire.FileList),
    Endpoint("GET", "/v1/files/{file_id}", files_routes.retrieve, "api", "Retrieve a file's object", None, b.FileObject),
    Endpoint("DELETE", "/v1/files/{file_id}", files_routes.delete, "api", "Delete a file", None, files_wire.FileDeleted),
    Endpoint("GET", "/v1/files/{file_id}/content", files_routes.content, "api", "Download a file's content"),
    Endpoint("POST", "/v1/batches", batches_routes.create, "api",
             "Create a batch of requests from an uploaded file",
             batches_wire.BatchCreate, b.Batch),
    Endpoint("GET", "/v1/batches", batches_routes.list_batches, "api", "List the key's batches, newest first", None,
             batches_wire.BatchList),
    Endpoint("GET", "/v1/batches/{batch_id}", batches_routes.retrieve, "api", "Retrieve a batch", None, b.Batch),
    Endpoint("POST", "/v1/batches/{batch_id}/cancel", batches_routes.cancel, "api", "Cancel a batch", None, b.Batch),
    Endpoint("POST", "/tokenize", native_routes.tokenize, "api", "Tokenize a prompt or chat messages",
             native_wire.TokenizeRequest, native_wire.TokenizeResponse),
    Endpoint("POST", "/detokenize", native_routes.detokenize, "api", "Turn token ids into text",
             native_wire.DetokenizeRequest, native_wire.DetokenizeResponse),
    Endpoint("POST", "/generate", native_routes.generate, "api", "Native API: generate text",
             native_wire.GenerateRequest, native_wire.GenerateResponse),
    Endpoint("POST", "/stream-generate", native_routes.stream_generate, "api", "Native API: stream text (SSE)",
             native_wire.GenerateRequest, native_wire.GenerateResponse, streams=True),
    Endpoint("GET", "/stream-generate/streams/{stream_id}", resuming("/stream-generate"), "api",
             "Native API: resume a stream after its Last-Event-ID, on any replica (SSE)"),
    Endpoint("POST", "/chat", native_routes.chat_native, "api",
             "Native API: chat messages in, text out (SSE with stream)",
             native_wire.NativeChatRequest, native_wire.GenerateResponse, streams=True),
    Endpoint("GET", "/chat/streams/{stream_id}", resuming("/chat"), "api",
             "Native API: resume a /chat stream after its Last-Event-ID, on any replica (SSE)"),
    Endpoint("POST", "/mcp", mcp_routes.exchange, "api", "The MCP gateway (streamable HTTP, JSON-RPC): the servers "
             "file's tools the key may call, named <server>__<tool> (docs/mcp.md)", per_call=True),
    Endpoint("POST", "/v1/load_lora_adapter", admin_routes.load_adapter, "admin",
             "Load a LoRA adapter (admin keys only)",
             ad.LoadAdapterRequest),
    Endpoint("POST", "/v1/unload_lora_adapter", admin_routes.unload_adapter, "admin",
             "Unload a LoRA adapter once its requests in flight finish (admin keys only)", ad.UnloadAdapterRequest),
    Endpoint("GET", "/openapi.json", openapi, "open", "This document"),
    Endpoint("GET", "/metrics", ops_routes.prometheus, "ops", "Prometheus metrics"),
    Endpoint("GET", "/metrics/router", ops_routes.router_metrics, "ops",
             "The pod's load for an endpoint picker: vLLM's five series it reads, one sample each"),
    Endpoint("GET", "/health", ops_routes.health, "ops", "Liveness"),
    Endpoint("GET", "/ready", ops_routes.ready, "ops", "Readiness"),
])
