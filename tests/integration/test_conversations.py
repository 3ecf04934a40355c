"""The Conversations API end to end on the session's gateway and engine, through the openai SDK: a conversation made,
two Responses turns in it (the second reading the first), its items listed, then deleted. The routes, refusals,
ownership and Redis are tested in-process (tests/unit/test_conversations.py)."""

from __future__ import annotations

import openai
import pytest

from tests.integration.conftest import MODEL

pytestmark = [pytest.mark.integration, pytest.mark.gateway_only("conversations are the gateway's store")]


def test_two_turns_in_a_conversation(sdk: openai.OpenAI) -> None:
    made = sdk.conversations.create(items=[{"role": "developer", "content": "Answer briefly."}], metadata={"t": "1"})
    assert sdk.conversations.retrieve(made.id).metadata == {"t": "1"}
    first = sdk.responses.create(model=MODEL, input="My name is Ada. Say hello to me.", conversation=made.id,
                                 temperature=0, max_output_tokens=20)
    second = sdk.responses.create(model=MODEL, input="What is my name?", conversation={"id": made.id},
                                  temperature=0, max_output_tokens=20)
    assert second.conversation is not None
    assert second.conversation.id == made.id
    # the prompt held the first turn, question and answer (too small a model to rely on its memory)
    assert second.usage is not None
    assert first.usage is not None
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens
    items = list(sdk.conversations.items.list(made.id, order="asc"))
    assert [item.role for item in items] == ["developer", "user", "assistant", "user", "assistant"]  # type: ignore[union-attr]
    assert items[-1].id == second.output[0].id
    assert sdk.conversations.delete(made.id).deleted
    with pytest.raises(openai.NotFoundError):
        sdk.conversations.retrieve(made.id)
