"""OpenAI's API as pydantic models. Requests forbid unknown fields (a typo is a 400) and every integer is bounded, so
no client-sent number reaches the engine, the cache key or a tokenizer unbounded. Also the cursor paging of its lists
(`page_of`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, ClassVar, Literal, Self, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from gateway.errors import InvalidRequest

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
Count = Annotated[int, Field(ge=0, le=INT64_MAX)]  # a number of tokens
TokenId = Annotated[int, Field(ge=0, le=INT64_MAX)]  # checked against the vocabulary later
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]
TOKEN_ID_KEY = re.compile(r"[0-9]{1,19}")  # ASCII digits only: str.isdigit() takes "²" too
T = TypeVar("T")
L = TypeVar("L", bound=BaseModel)


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class _Response(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False


StopString = Annotated[str, Field(min_length=1)]  # an empty one would stop everywhere: the engine refuses it
Stop = StopString | Annotated[list[StopString], Field(max_length=4)] | None


class ModelRequest(_Request):
    """What the dispatcher reads of every request it routes: the model, the end user (sticky A/B
    splits) and whether the answer streams."""

    model: str
    user: str | None = None
    prompts_param: ClassVar[str] = "prompt"  # the field that may hold several prompts (completions', embeddings')

    @property
    def streams(self) -> bool:
        return bool(getattr(self, "stream", False))  # chat's and completions' field (embeddings never stream)

    def prompt_count(self) -> int:
        """Prompts in the request, each its own engine request: a list of strings or of token id
        lists is several, a string or a list of token ids one."""
        # the fields' own dict: on a request without that field (chat's) `getattr` goes through pydantic's
        # `__getattr__` and raises and catches an AttributeError, called several times per request
        value = self.__dict__.get(self.prompts_param)
        if not isinstance(value, list) or all(isinstance(item, int) for item in value):
            return 1
        return len(value)

    def engine_requests(self) -> int:
        """The requests the engine runs for this one, as it counts them."""
        return self.prompt_count()

    def continued(self, text: str, tokens: int) -> tuple[Self, str] | None:
        """This request asked to go on after `text`, the first `tokens` of its answer (mid-stream
        failover, `serving.continuation`), and the trailing whitespace held back from the text it
        hands on; None: an answer that cannot be continued soundly elsewhere."""
        return None


class Sampling(_Request):
    """The sampling parameters every generating request takes, the native API's too (OpenAI's, then vLLM's)."""

    temperature: Annotated[float, Field(ge=0, le=2)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    stop: Stop = None
    seed: Seed | None = None
    presence_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Field(ge=-2, le=2)] = 0.0
    # vLLM's extra sampling parameters (the openai SDK sends them through `extra_body`)
    top_k: Annotated[int, Field(ge=-1, le=INT64_MAX)] | None = None
    min_p: Annotated[float, Field(ge=0, le=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=2)] | None = None
    ignore_eos: bool = False


class SamplingFields(ModelRequest, Sampling):
    """Parameters shared by chat and completions (OpenAI's, then vLLM's extras)."""

    n: Annotated[int, Field(ge=1, le=128)] = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, Annotated[float, Field(ge=-100, le=100)]] | None = None
    min_tokens: Count = 0
    stop_token_ids: list[TokenId] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # priority (tenancy.priority): OpenAI's tier, and vLLM's integer (lower first); raising it above
    # the key's class needs the key's `request_priority`
    service_tier: Literal["auto", "default", "flex", "priority"] | None = None
    priority: Annotated[int, Field(ge=-(2**31), le=2**31 - 1)] | None = None

    @field_validator("logit_bias")
    @classmethod
    def _token_ids(cls, value: dict[str, float] | None) -> dict[str, float] | None:
        for key in value or {}:
            if not TOKEN_ID_KEY.fullmatch(key):
                raise ValueError(f"logit_bias keys must be token ids (up to 19 digits), got {key[:40]!r}")
        return value

    @model_validator(mode="after")
    def _stream_options_need_stream(self) -> SamplingFields:
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def engine_requests(self) -> int:
        """Each choice of each prompt."""
        return self.prompt_count() * self.n


class TextPart(_Request):
    type: Literal["text"]
    text: str


class ImagePart(_Request):
    type: Literal["image_url"]
    image_url: dict[str, Any]


class FunctionCall(_Request):
    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart | ImagePart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    refusal: str | None = None

    @model_validator(mode="after")
    def _content_required(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self


class JsonSchema(_Request):
    name: str
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type json_schema needs a json_schema")
        return self


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    logprobs: bool = False
    top_logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    response_format: ResponseFormat | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None
    # vLLM's: the last (assistant) message continued rather than answered
    add_generation_prompt: bool = True
    continue_final_message: bool = False

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs set to true")
        return self

    @field_validator("continue_final_message")
    @classmethod
    def _continues_an_assistant_turn(cls, value: bool, info: ValidationInfo) -> bool:
        messages, prompt = info.data.get("messages"), info.data.get("add_generation_prompt")
        if value and (prompt or not messages or messages[-1].role != "assistant"):
            raise ValueError("continue_final_message needs add_generation_prompt false and an assistant message last")
        return value

    def continued(self, text: str, tokens: int) -> tuple[Self, str] | None:
        """The conversation with `text` as a partial assistant turn to continue (`continue_final_message`),
        its trailing whitespace held back (a template may trim it; the next token brings it again).
        Not for several choices, tools or constrained output: a grammar would start again where the
        text stops, and a call's arguments cut in half are no call."""
        tools = bool(self.tools) and self.tool_choice != "none"
        if self.n != 1 or tools or (self.response_format is not None and self.response_format.type != "text"):
            return None
        messages, whole = list(self.messages), text
        if self.continue_final_message:  # the client's own partial turn, continued further
            last = messages.pop()
            if not isinstance(last.content, str | None):
                return None
            whole = (last.content or "") + text
        partial = whole.rstrip()
        messages.append(ChatMessage(role="assistant", content=partial))
        most = self.max_completion_tokens or self.max_tokens
        field = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        update: dict[str, Any] = {"messages": messages, "continue_final_message": True, "add_generation_prompt": False,
                                  "min_tokens": max(0, self.min_tokens - tokens)}
        if most is not None:
            update[field] = max(1, most - tokens)
        return self.model_copy(update=update), whole[len(partial):]


Prompt = (
    str
    | Annotated[list[str], Field(min_length=1)]
    | Annotated[list[TokenId], Field(min_length=1)]
    | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
)


class CompletionRequest(SamplingFields):
    prompt: Prompt
    max_tokens: Count | None = 16
    echo: bool = False
    logprobs: Annotated[int, Field(ge=0, le=20)] | None = None
    best_of: Annotated[int, Field(ge=1, le=20)] | None = None
    suffix: str | None = None
    truncate_prompt_tokens: Annotated[int, Field(ge=1, le=INT64_MAX)] | None = None

    def engine_requests(self) -> int:
        return self.prompt_count() * max(self.n, self.best_of or 1)

    def continued(self, text: str, tokens: int) -> tuple[Self, str] | None:
        """The prompt with `text` appended (one text prompt, one choice, no suffix: a prompt continues
        naturally), its echo already sent."""
        prompt = self.prompt if isinstance(self.prompt, str) else None
        if isinstance(self.prompt, list) and len(self.prompt) == 1 and isinstance(self.prompt[0], str):
            prompt = self.prompt[0]
        if prompt is None or self.n != 1 or (self.best_of or 1) != 1 or self.suffix:
            return None
        update: dict[str, Any] = {"prompt": prompt + text, "echo": False, "min_tokens": max(0, self.min_tokens - tokens)}
        if self.max_tokens is not None:
            update["max_tokens"] = max(1, self.max_tokens - tokens)
        return self.model_copy(update=update), ""


class Usage(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: dict[str, int] | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    finish_reason: str | None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    service_tier: str | None = None  # the tier the request ran in (tenancy.priority)


class ChunkDelta(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(_Response):
    index: int
    delta: ChunkDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    usage: Usage | None = None
    service_tier: str | None = None


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(_Response):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "llm-gateway"
    root: str | None = None
    max_model_len: int | None = None
    version: str | None = None  # the SemVer version of a versioned model (its id is name@version)
    parent: str | None = None  # a LoRA adapter's base model (as vLLM's cards say)


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class ErrorBody(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorBody


def page_of(items: list[T], ids: list[str], limit: int, after: str | None, *, missing: str, before: str | None = None,
            names: tuple[str, str] = ("after", "before")) -> tuple[list[T], bool]:
    """The page of `items` (whose ids are `ids`) after `after` or before `before`, and whether more follow; an unknown
    cursor a 400 naming its field (of `names`), `missing` its message (formatted with its direction and the cursor)."""
    for cursor, name in ((after, names[0]), (before, names[1])):
        if cursor is not None and cursor not in ids:
            raise InvalidRequest(missing.format(name.partition("_")[0], cursor), param=name)
    if before is not None:
        end = ids.index(before)
        return items[max(0, end - limit) : end], end - limit > 0
    start = 0 if after is None else ids.index(after) + 1
    return items[start : start + limit], start + limit < len(items)


def listing(model: type[L], data: list[Any], more: bool) -> L:
    """A page of a list as OpenAI writes one: its items, the first's and the last's ids, whether more follow."""
    return model(data=data, first_id=data[0].id if data else None, last_id=data[-1].id if data else None, has_more=more)
