"""Tool calling: which tools a request offers, how the model is steered to call them, and how
calls are read back out of its text.

- `none` (or no tools): plain chat.
- a named function: the output is constrained to that function's parameter schema; the whole
  output is the call's arguments.
- `required`: the output is constrained to a JSON array of `{"name", "parameters"}` objects, one
  per call, each name one of the tools and its parameters that tool's schema.
- `auto`: the tools go to the chat template (or, for templates that take no tools, into a system
  message asking for `<tool_call>{"name": ..., "arguments": ...}</tool_call>`, the Hermes format
  that many open models are trained on); calls are parsed out of the text in that format.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from gateway.errors import InvalidRequest
from gateway.protocol.openai import ChatCompletionRequest

Mode = Literal["none", "auto", "required", "named"]
ANY_OBJECT: dict[str, Any] = {"type": "object"}
TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

SYSTEM_PROMPT = """You may call functions to help with the user's request. Available functions:
{functions}
To call a function, answer with one line per call, exactly in this format:
<tool_call>{{"name": "<function name>", "arguments": {{<arguments as JSON>}}}}</tool_call>
If no function is needed, answer normally."""


TAG = "<tool_call>"


def _partial_tag(text: str) -> int:
    """How many characters at the end of `text` may be the start of a `<tool_call>` tag."""
    for size in range(min(len(TAG) - 1, len(text)), 0, -1):
        if text.endswith(TAG[:size]):
            return size
    return 0


class HeldText:
    """An answer's text as it may be streamed while it arrives, by tool mode: all of it without
    tools (`none`); with `auto`, all but what may begin a `<tool_call>` tag and the whitespace
    before one (the whole answer strips it), and nothing once a tag has begun (the calls are
    parsed from the whole text at its end). `sent`: the characters released so far."""

    __slots__ = ("auto", "sent", "tagged", "text")

    def __init__(self, mode: Mode) -> None:
        self.text = ""
        self.sent = 0
        self.tagged = False
        self.auto = mode == "auto"

    def feed(self, piece: str) -> str:
        """Add `piece`; the text that may be streamed now."""
        self.text += piece
        if not self.auto:
            end = len(self.text)
        elif self.tagged:
            return ""
        else:
            at = self.text.find(TAG, self.sent)
            self.tagged = at >= 0
            cut = at if self.tagged else len(self.text) - _partial_tag(self.text)
            end = max(self.sent, len(self.text[:cut].rstrip()))
        released, self.sent = self.text[self.sent : end], end
        return released

    def rest(self, calls: bool) -> str:
        """At the end: the content not yet streamed; with calls, up to the first tag (its
        whitespace before it left out, as the whole answer's content has it)."""
        end = max(self.sent, len(self.text[: self.text.find(TAG)].rstrip())) if calls else len(self.text)
        rest, self.sent = self.text[self.sent : end], end
        return rest


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def as_openai(self, index: int | None = None) -> dict[str, Any]:
        call: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            call["index"] = index
        return call


@dataclass(frozen=True, slots=True)
class ToolPlan:
    mode: Mode
    functions: dict[str, dict[str, Any]]  # name → OpenAI function object
    named: str | None = None
    parallel: bool = True

    @property
    def active(self) -> bool:
        return self.mode != "none"

    def json_schema(self) -> dict[str, Any] | None:
        """The constraint on the output, for `required` and a named function."""
        if self.mode == "named":
            return self.functions[self.named or ""].get("parameters") or ANY_OBJECT
        if self.mode == "required":
            calls = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": fn.get("parameters") or ANY_OBJECT,
                    },
                    "required": ["name", "parameters"],
                }
                for name, fn in self.functions.items()
            ]
            schema: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": calls}}
            if not self.parallel:
                schema["maxItems"] = 1
            return schema
        return None

    def finish_reason(self, calls: list[ToolCall], reason: str | None) -> str | None:
        # OpenAI answers a forced (named) call with "stop", other calls with "tool_calls"
        if calls and self.mode in ("auto", "required") and reason == "stop":
            return "tool_calls"
        return reason

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content, calls) from a finished choice's text."""
        if self.mode == "named":
            return None, [ToolCall(self.named or "", text)]
        if self.mode == "required":
            return None, _parse_required(text)
        if self.mode == "auto":
            return _parse_tagged(text, self.functions)
        return text, []


def plan(request: ChatCompletionRequest) -> ToolPlan:
    """Validate `tools` and `tool_choice` together; refuse what does not fit with a 400."""
    functions = _functions(request.tools or [])
    choice = request.tool_choice
    parallel = request.parallel_tool_calls is not False
    if choice is not None and not functions and choice != "none":
        raise InvalidRequest("tool_choice is only allowed when tools are specified", "tool_choice")
    if not functions or choice == "none":
        return ToolPlan("none", functions, parallel=parallel)
    if choice is None or choice == "auto":
        return ToolPlan("auto", functions, parallel=parallel)
    if choice == "required":
        return ToolPlan("required", functions, parallel=parallel)
    if isinstance(choice, dict):
        function = choice.get("function") if choice.get("type") == "function" else None
        name = function.get("name") if isinstance(function, dict) else None
        if not isinstance(name, str):  # a missing function, or a name of another type (a list is unhashable)
            raise InvalidRequest("tool_choice must name a function: {\"type\": \"function\", \"function\": "
                                 "{\"name\": ...}}", "tool_choice")
        if name not in functions:
            raise InvalidRequest(f"tool_choice names a function not in tools: {name!r}", "tool_choice")
        return ToolPlan("named", functions, named=name, parallel=parallel)
    raise InvalidRequest(
        "tool_choice must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        "tool_choice",
    )


def _functions(tools: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    functions: dict[str, dict[str, Any]] = {}
    for i, tool in enumerate(tools):
        fn = tool.get("function")
        if tool.get("type") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise InvalidRequest("each tool must be {\"type\": \"function\", \"function\": {\"name\": ...}}", f"tools.{i}")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise InvalidRequest("a function's parameters must be a JSON schema object", f"tools.{i}.function.parameters")
        functions[fn["name"]] = fn
    return functions


def with_tools_described(messages: list[dict[str, Any]], plan: ToolPlan) -> list[dict[str, Any]]:
    """For chat templates that take no tools: describe them in the system message."""
    listing = "\n".join(json.dumps(fn, separators=(",", ":")) for fn in plan.functions.values())
    if plan.mode == "auto":
        text = SYSTEM_PROMPT.format(functions=listing)
    else:  # the output is constrained to JSON already; the model needs only the functions
        text = f"Available functions:\n{listing}\nAnswer with the function call as JSON."
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
    return [{"role": "system", "content": text}, *messages]


def tagged(call: dict[str, Any]) -> str:
    """An earlier assistant tool call, written back as the model is asked to write them."""
    function = call["function"]
    try:
        arguments = json.loads(function["arguments"])
    except (json.JSONDecodeError, TypeError):
        arguments = function["arguments"]
    return TAG + json.dumps({"name": function["name"], "arguments": arguments}) + "</tool_call>"


def _complete_items(text: str) -> list[Any]:
    """The complete items of a JSON array, also when max_tokens cut the array short."""
    try:
        items = json.loads(text)
        return items if isinstance(items, list) else []
    except json.JSONDecodeError:
        pass
    decoder, items = json.JSONDecoder(), []
    position = text.find("[") + 1
    while 0 < position < len(text):
        while position < len(text) and text[position] in " \t\r\n,":
            position += 1
        try:
            item, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            break
        items.append(item)
    return items


def _parse_required(text: str) -> list[ToolCall]:
    items = _complete_items(text)
    return [
        ToolCall(item["name"], json.dumps(item.get("parameters", {})))
        for item in items
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]


def _parse_tagged(text: str, functions: dict[str, dict[str, Any]]) -> tuple[str | None, list[ToolCall]]:
    calls = []
    for match in TOOL_CALL.finditer(text):
        try:
            item = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if isinstance(item, dict) and item.get("name") in functions:
            arguments = item.get("arguments", item.get("parameters", {}))
            calls.append(ToolCall(item["name"], arguments if isinstance(arguments, str) else json.dumps(arguments)))
    if not calls:
        return text, []
    content = text[: text.find(TAG)].strip()
    return content or None, calls
