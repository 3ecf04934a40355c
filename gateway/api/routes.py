"""The one route table (`TABLE`): every path the gateway serves, once, with its access class (`api`, `ops`, `open`,
`admin`); every layer reads its routes from here (tests/unit/test_routes.py)."""

from __future__ import annotations

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from gateway.api import admin, batches, embeddings, files, handlers, message_batches, messages, native, ops, responses
from gateway.api.openapi import document
from gateway.api.table import Endpoint, RouteTable
from gateway.protocol import adapters as ad
from gateway.protocol import anthropic as a
from gateway.protocol import batches as b
from gateway.protocol import embeddings as e
from gateway.protocol import files as f
from gateway.protocol import message_batches as mb
from gateway.protocol import openai as p
from gateway.protocol import responses as r


async def openapi(request: Request) -> Response:
    return JSONResponse(document(TABLE.endpoints))


TABLE = RouteTable([
    Endpoint("POST", "/v1/chat/completions", handlers.chat_completions, "api", "Create a chat completion",
             p.ChatCompletionRequest, p.ChatCompletion, streams=True),
    Endpoint("POST", "/v1/completions", handlers.text_completions, "api", "Create a completion",
             p.CompletionRequest, p.Completion, streams=True),
    Endpoint("POST", "/v1/embeddings", embeddings.create, "api", "Create embeddings", e.EmbeddingRequest,
             e.CreateEmbeddingResponse),
    Endpoint("POST", "/v1/messages", messages.create, "api", "Create a message (Anthropic's Messages API)",
             a.MessagesRequest, a.Message, streams=True, dialect="anthropic"),
    Endpoint("POST", "/v1/messages/count_tokens", messages.count_tokens, "api", "Count a message's input tokens "
             "(Anthropic's API)", a.CountTokensRequest, a.MessageTokensCount, dialect="anthropic"),
    Endpoint("POST", "/v1/messages/batches", message_batches.collection, "api", "Create a Message Batch "
             "(Anthropic's API)", mb.MessageBatchCreate, mb.MessageBatch, dialect="anthropic"),
    Endpoint("GET", "/v1/messages/batches", message_batches.collection, "api", "List the key's Message Batches, "
             "newest first (Anthropic's API)", None, mb.MessageBatchList, dialect="anthropic"),
    Endpoint("GET", "/v1/messages/batches/{message_batch_id}", message_batches.by_id, "api",
             "Retrieve a Message Batch (Anthropic's API)", None, mb.MessageBatch, dialect="anthropic"),
    Endpoint("DELETE", "/v1/messages/batches/{message_batch_id}", message_batches.by_id, "api",
             "Delete a Message Batch that has ended (Anthropic's API)", None, mb.DeletedMessageBatch,
             dialect="anthropic"),
    Endpoint("POST", "/v1/messages/batches/{message_batch_id}/cancel", message_batches.cancel, "api",
             "Cancel a Message Batch (Anthropic's API)", None, mb.MessageBatch, dialect="anthropic"),
    Endpoint("GET", "/v1/messages/batches/{message_batch_id}/results", message_batches.results, "api",
             "A Message Batch's results, one JSON line per request (Anthropic's API)", dialect="anthropic"),
    Endpoint("GET", "/v1/models", handlers.list_models, "api", "List the served models", None, p.ModelList),
    Endpoint("GET", "/v1/models/{model:path}", handlers.retrieve_model, "api", "Retrieve a served model",
             None, p.ModelCard),
    Endpoint("POST", "/v1/responses", responses.create, "api", "Create a model response (Responses API)",
             r.ResponsesRequest, r.Response, streams=True),
    Endpoint("GET", "/v1/responses/{response_id}", responses.by_id, "api", "Retrieve a stored response", None, r.Response),
    Endpoint("DELETE", "/v1/responses/{response_id}", responses.by_id, "api", "Delete a stored response",
             None, r.ResponseDeleted),
    Endpoint("GET", "/v1/responses/{response_id}/input_items", responses.input_items, "api",
             "List the items a response took as input", None, r.ResponseItemList),
    Endpoint("POST", "/v1/responses/{response_id}/cancel", responses.cancel, "api", "Cancel a background response",
             None, r.Response),
    Endpoint("POST", "/v1/files", files.collection, "api", "Upload a file (multipart/form-data: file, purpose batch)",
             None, f.FileObject, upload=True),
    Endpoint("GET", "/v1/files", files.collection, "api", "List the key's files", None, f.FileList),
    Endpoint("GET", "/v1/files/{file_id}", files.by_id, "api", "Retrieve a file's object", None, f.FileObject),
    Endpoint("DELETE", "/v1/files/{file_id}", files.by_id, "api", "Delete a file", None, f.FileDeleted),
    Endpoint("GET", "/v1/files/{file_id}/content", files.content, "api", "Download a file's content"),
    Endpoint("POST", "/v1/batches", batches.collection, "api", "Create a batch of requests from an uploaded file",
             b.BatchCreate, b.Batch),
    Endpoint("GET", "/v1/batches", batches.collection, "api", "List the key's batches, newest first", None, b.BatchList),
    Endpoint("GET", "/v1/batches/{batch_id}", batches.retrieve, "api", "Retrieve a batch", None, b.Batch),
    Endpoint("POST", "/v1/batches/{batch_id}/cancel", batches.cancel, "api", "Cancel a batch", None, b.Batch),
    Endpoint("POST", "/tokenize", native.tokenize, "api", "Tokenize a prompt or chat messages",
             p.TokenizeRequest, p.TokenizeResponse),
    Endpoint("POST", "/detokenize", native.detokenize, "api", "Turn token ids into text",
             p.DetokenizeRequest, p.DetokenizeResponse),
    Endpoint("POST", "/generate", native.generate, "api", "Native API: generate text",
             p.GenerateRequest, p.GenerateResponse),
    Endpoint("POST", "/stream-generate", native.stream_generate, "api", "Native API: stream text (SSE)",
             p.GenerateRequest, p.GenerateResponse, streams=True),
    Endpoint("POST", "/chat", native.chat_native, "api", "Native API: chat messages in, text out (SSE with stream)",
             p.NativeChatRequest, p.GenerateResponse, streams=True),
    Endpoint("POST", "/v1/load_lora_adapter", admin.load_adapter, "admin", "Load a LoRA adapter (admin keys only)",
             ad.LoadAdapterRequest),
    Endpoint("POST", "/v1/unload_lora_adapter", admin.unload_adapter, "admin",
             "Unload a LoRA adapter once its requests in flight finish (admin keys only)", ad.UnloadAdapterRequest),
    Endpoint("GET", "/openapi.json", openapi, "open", "This document"),
    Endpoint("GET", "/metrics", ops.prometheus, "ops", "Prometheus metrics"),
    Endpoint("GET", "/metrics/router", ops.router_metrics, "ops",
             "The pod's load for an endpoint picker: vLLM's five series it reads, one sample each"),
    Endpoint("GET", "/health", ops.health, "ops", "Liveness"),
    Endpoint("GET", "/ready", ops.ready, "ops", "Readiness"),
])
