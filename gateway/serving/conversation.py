"""The checks OpenAI makes of a chat conversation beyond each field's type, made before the
template sees it: a refusal is a 400 naming the field (`messages.3.tool_call_id`), never a
conversation rendered as something else.

- a `tool` message needs a `tool_call_id`, and answers a call of an earlier assistant message
  (none before it: OpenAI's "must be a response to a preceding message with 'tool_calls'");
- a message's `name` matches OpenAI's pattern for it, `^[^\\s<|\\\\/>]+$` (no whitespace and no
  markup characters), at most 64 characters, and holds no control or format characters.

Roles in an order a template cannot render (strict user/assistant alternation, say) are the
template's to refuse: its refusal is a 400 on `messages` (`engine.tokenizer`).
"""

from __future__ import annotations

import re
import unicodedata
from collections.abc import Sequence

from gateway.errors import InvalidRequest
from gateway.protocol.openai import ChatMessage

NAME = re.compile(r"[^\s<|\\/>]{1,64}")
INVISIBLE = ("Cc", "Cf", "Cs", "Co", "Cn")  # control, format (zero-width), surrogate, private, unassigned


def check_name(name: str, param: str) -> None:
    if not NAME.fullmatch(name) or any(unicodedata.category(c) in INVISIBLE for c in name):
        raise InvalidRequest(
            f"Invalid '{param}': string does not match pattern. Expected a string of 1 to 64 characters "
            "without whitespace, control characters or any of < | \\ / > (the pattern '^[^\\s<|\\\\/>]+$').",
            param,
        )


def check_messages(messages: Sequence[ChatMessage]) -> None:
    """Refuse (InvalidRequest) what OpenAI refuses of these messages; see the module docstring."""
    called: set[str] = set()
    for i, message in enumerate(messages):
        if message.name is not None:
            check_name(message.name, f"messages.{i}.name")
        if message.role == "assistant" and message.tool_calls:
            called.update(call.id for call in message.tool_calls)
        if message.role == "tool":
            _check_tool_message(message, i, called)


def _check_tool_message(message: ChatMessage, index: int, called: set[str]) -> None:
    if message.tool_call_id is None:
        param = f"messages.{index}.tool_call_id"
        raise InvalidRequest(f"Missing required parameter: '{param}'.", param)
    if not called:
        raise InvalidRequest("Invalid parameter: messages with role 'tool' must be a response to a preceding "
                             "message with 'tool_calls'.", f"messages.{index}.role")
    if message.tool_call_id not in called:
        raise InvalidRequest(f"Invalid parameter: 'tool_call_id' of '{message.tool_call_id}' not found in "
                             "'tool_calls' of previous message.", f"messages.{index}.tool_call_id")
