"""The engine interface, in the gateway's own terms; nothing here imports vllm."""

from __future__ import annotations

from collections.abc import AsyncGenerator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

Task = Literal["generate", "embed"]  # what a model does: generate text, or embed (vLLM's pooling runner)

from engine.config import SamplingDefaults


@dataclass(slots=True)  # not frozen: built per request, and a frozen init costs more
class SamplingOptions:
    """Everything that shapes the output of one generation (OpenAI's and vLLM's parameters); read-only
    once built."""

    max_tokens: int
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None  # top alternatives per sampled token; None: no logprobs
    prompt_logprobs: int | None = None
    json_schema: dict[str, Any] | None = None  # constrain the output to this JSON schema
    json_object: bool = False  # constrain the output to any JSON object
    compact_json: bool = False  # no free whitespace inside constrained JSON (fewer tokens)


@dataclass(frozen=True, slots=True)
class TokenLogprob:
    token_id: int
    token: str
    logprob: float | None  # None only for a prompt's first token, which has no context
    rank: int | None = None
    top: tuple[tuple[int, str, float], ...] = ()  # (token id, token text, logprob), best first


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    """A piece of one tool call, as a backend that parses calls itself streams it (a remote upstream)."""

    index: int
    arguments: str = ""
    name: str | None = None  # with the call's first piece
    id: str | None = None


@dataclass(slots=True)  # not frozen: built per token, and a frozen init costs more
class ChoiceDelta:
    """What one choice (of n) produced since the previous output of the same request."""

    index: int
    text: str
    token_ids: Sequence[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    logprobs: tuple[TokenLogprob, ...] | None = None
    cumulative_logprob: float | None = None  # of the whole choice so far, when logprobs are on
    reasoning: str = ""  # a backend's reasoning text, apart from the answer's (a remote upstream's)
    tool_calls: tuple[ToolCallDelta, ...] = ()  # calls the backend parsed itself (a remote upstream's)


@dataclass(slots=True)
class GenerationOutput:
    """One step of a generation: new deltas for some of its choices."""

    prompt_tokens: int
    choices: Sequence[ChoiceDelta]
    finished: bool
    cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
    completion_tokens: int | None = None  # the backend's own count, with its last output (a remote upstream's usage)


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingOptions
    prompt_text: str | None = None
    trace_headers: Mapping[str, str] | None = None  # W3C traceparent (and tracestate) of the caller's span
    adapter: str | None = None  # a LoRA adapter loaded into this engine (`Engine.load_adapter`), by name
    priority: int = 0  # vLLM's: lower runs first (and is preempted last) under priority scheduling
    forward: Forward | None = None  # a remote backend's request: what it is sent instead of the token ids


@dataclass(frozen=True, slots=True)
class Forward:
    """A generation as a remote upstream is asked for it: its route, the request it is sent, the
    prompt's tokens as estimated (no tokenizer of the upstream's model here), and the most tokens
    a choice may bring (an upstream that streams past it is cut)."""

    path: str
    payload: Mapping[str, Any]
    prompt_tokens: int
    max_tokens: int


@dataclass(frozen=True, slots=True)
class EmbedRequest:
    """Inputs to embed, each answered with one pooled, L2-normalised vector, in order."""

    request_id: str
    inputs: list[list[int]]  # each input's token ids (a remote backend's: none, `forward` names them)
    dimensions: int | None = None  # a Matryoshka model's shorter vector (re-normalised); None: full size
    forward: Forward | None = None  # a remote backend's request: what it is sent instead of the token ids


@dataclass(frozen=True, slots=True)
class Embeddings:
    """A backend's vectors for an EmbedRequest's inputs, in order, and the prompt tokens they took."""

    vectors: list[list[float] | str]  # str: base64 of little-endian float32, as a remote upstream sent it
    prompt_tokens: int


@dataclass(frozen=True, slots=True)
class ModelInfo:
    name: str
    max_model_len: int
    root: str = ""
    created: int = 0
    extra: dict[str, Any] = field(default_factory=dict)
    # what a request leaves unsaid: the models file's defaults over the model's generation_config.json
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    task: Task = "generate"
    embedding_size: int | None = None  # embedding models: the vector's length
    matryoshka: bool = False  # embedding models: shorter vectors (`dimensions`) are meaningful


@dataclass(frozen=True, slots=True)
class AdapterLoad:
    """An engine's LoRA adapters at work, as vLLM's scheduler last reported them (what its
    `vllm:lora_requests_info` carries): engine requests running and waiting per adapter name."""

    max_loras: int  # adapters one batch may hold
    running: Mapping[str, int] = field(default_factory=dict)
    waiting: Mapping[str, int] = field(default_factory=dict)
    updated: float = 0.0  # Unix time of that report (0: none yet)


@dataclass(frozen=True, slots=True)
class ChatPrompt:
    """A rendered chat prompt: its text (logs, guards) and the token ids the engine reads."""

    text: str
    token_ids: list[int]


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """The engine's scheduler at its last step, as a request router reads it (vLLM's `vllm:*` gauges
    of the same meaning): built by the engine as it steps, so reading it costs nothing."""

    running: int = 0  # requests in the running batch
    waiting: int = 0  # requests queued in the engine (deferred ones included)
    kv_cache_usage: float = 0.0  # fraction of the KV cache's blocks in use, 0 to 1
    block_size: int = 0  # tokens per KV-cache block
    num_blocks: int = 0  # KV-cache blocks (vLLM's num_gpu_blocks, on the CPU too)
    max_lora: int = 0  # LoRA adapters the engine can hold at once (0: LoRA off)
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    # seconds a request spends in the engine (its queue, prefill and decode, on the engine's own clock),
    # averaged over the recent ones that finished; None: none yet. Admission's expected wait reads it:
    # it leaves out the front's intake and delivery, which a burst of arrivals stretches
    request_s: float | None = None
    batch: int = 0  # requests the engine runs at once at most (vLLM's max_num_seqs, every rank's); 0: not known
    first_token_s: float | None = None  # of request_s, its queue and prefill: until its first token (a stream's answer)


ConstraintKind = Literal["json_schema", "json_object", "regex", "grammar"]


@dataclass(frozen=True, slots=True)
class Verdict:
    """A constraint's compile check: `error` None when it compiled (in `seconds`)."""

    error: str | None
    seconds: float = 0.0
    timed_out: bool = False
    cached: bool = False

    @property
    def ok(self) -> bool:
        return self.error is None


class GrammarCheck(Protocol):
    """Compiles structured-output constraints as the engine will, before it sees them
    (`engine.grammar`): bounded in time, cancelled with the caller."""

    async def check(self, kind: ConstraintKind, spec: str, any_whitespace: bool, timeout_s: float) -> Verdict:
        """The constraint's verdict; a compile past `timeout_s` is stopped and refused."""
        ...

    async def close(self) -> None: ...


@runtime_checkable
class Tokenizer(Protocol):
    takes_tools: bool  # whether the chat template renders a `tools` argument

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text` as the tokenizer reads it: added-token spellings (`<|im_end|>`) become those tokens."""
        ...

    def encode_prompt(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """A completion's raw prompt: added-token spellings read as the model's setting says
        (`EngineSettings.prompt_special_tokens`)."""
        ...

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = False) -> str: ...

    def encode_chat(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> ChatPrompt:
        """Messages through the chat template: every string in `messages` and `kwargs` is the
        client's and is encoded as text; only the template's own markup becomes special tokens."""
        ...


class Generator(Protocol):
    """What every backend is to the pipeline (the embedded engine, a remote upstream): its name (in
    `info`), a generation started as a stream of outputs ending in a finish reason per choice and
    the usage (closing it aborts the generation), embeddings, its health and its shutdown."""

    @property
    def info(self) -> ModelInfo: ...

    def generate(self, request: GenerationRequest) -> AsyncGenerator[GenerationOutput, None]:
        """Stream outputs; closing or cancelling the iterator aborts the request in the backend."""
        ...

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """The vectors of every input (embedding models only); cancelling aborts them in the backend."""
        ...

    async def check_health(self) -> None:
        """Return if the backend can serve; raise EngineUnavailable if not."""
        ...

    async def shutdown(self) -> None: ...


class Engine(Generator, Protocol):
    """A loaded model that generates (or, when its `info.task` is "embed", embeds). All errors
    raised are `engine.errors.EngineError`s."""

    @property
    def tokenizer(self) -> Tokenizer: ...

    async def abort(self, request_id: str) -> None: ...

    @property
    def healthy(self) -> bool:
        """False once the engine can no longer serve (its core dead), read without I/O: a request is
        refused at once then, not after its preparation fails in the engine."""
        ...

    def load(self) -> EngineLoad:
        """The scheduler's numbers at its last step (no I/O, no lock: a router scrapes them often)."""
        ...

    async def load_adapter(self, name: str, path: str) -> None:
        """Load the LoRA adapter in `path` under `name`, for requests that name it (`GenerationRequest.
        adapter`); EngineInvalidRequest when it cannot be (LoRA off, a bad directory, too high a rank)."""
        ...

    async def unload_adapter(self, name: str) -> None:
        """Forget the adapter `name`; requests that still name it are refused (EngineInvalidRequest)."""
        ...

    def adapter_load(self) -> AdapterLoad | None:
        """The adapters at work (None: this engine serves no adapters, LoRA off)."""
        ...
