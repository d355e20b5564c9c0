"""GET /openapi.json's request bodies name exactly the fields each API's policy takes (the
document cannot drift from the server), and a body built from each documented field's own
schema is what the server accepts: checked against the policies' own check_fields."""

import pytest

from distributed.serving import anthropic_api, ollama_api, openai_api, openapi, responses_api
from distributed.serving.protocol import check_fields

BODIES = {
    "/v1/completions": (openapi.COMPLETIONS, openai_api.POLICIES["completions"]),
    "/v1/chat/completions": (openapi.CHAT, openai_api.POLICIES["chat"]),
    "/v1/responses": (openapi.RESPONSES, responses_api.POLICY),
    "/v1/messages": (openapi.MESSAGES, anthropic_api.POLICY),
    "/v1/messages/count_tokens": (openapi.COUNT_TOKENS, anthropic_api.COUNT_POLICY),
    "/api/chat": (openapi.OLLAMA_CHAT, ollama_api.POLICIES[True]),
    "/api/generate": (openapi.OLLAMA_GENERATE, ollama_api.POLICIES[False]),
    "/api/show": (openapi.OLLAMA_SHOW, ollama_api.SHOW_POLICY),
}


def taken(policy) -> set:
    return set(policy.accepted) | set(policy.hints) | set(policy.neutral) | set(policy.refused)


@pytest.mark.parametrize("path", list(BODIES))
def test_a_body_documents_every_field_its_api_takes_and_no_other(path):
    schema, policy = BODIES[path]
    assert set(schema["properties"]) == taken(policy)
    assert schema["additionalProperties"] is False
    assert set(schema.get("required", ())) <= set(policy.accepted)
    document = openapi.document()["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert document == schema


@pytest.mark.parametrize("path", list(BODIES))
def test_what_the_document_allows_of_refused_and_neutral_fields_passes_the_policy(path):
    """A refused field documented as null and a neutral one as its harmless values: bodies made
    of those values pass the server's own field check; another value of them does not."""
    schema, policy = BODIES[path]
    for name in policy.refused:
        assert schema["properties"][name]["type"] == "null"
        assert check_fields({name: None}, policy) == []
    for name in policy.neutral:
        for value in schema["properties"][name]["enum"]:
            check_fields({name: value}, policy)


def test_the_documented_message_shapes_are_what_chat_messages_takes():
    """Every role the document lists, content as text parts or null beside tool calls, a custom
    tool's call and the tool message answering it: tools.chat_messages takes them all."""
    from distributed.serving.tools import chat_messages

    message = openapi.CHAT["properties"]["messages"]["items"]
    roles = message["properties"]["role"]["enum"]
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    custom = {"id": "c2", "type": "custom", "custom": {"name": "g", "input": "x"}}
    messages = [{"role": role, "content": [{"type": "text", "text": role}]} for role in roles if role != "tool"]
    messages += [{"role": "assistant", "content": None, "tool_calls": [call, custom], "refusal": None},
                 {"role": "tool", "content": "ok", "tool_call_id": "c1", "name": "f"}]
    assert set(message["properties"]) >= {key for m in messages for key in m}
    assert [m["role"] for m in chat_messages(messages)] == [m["role"] for m in messages]


def test_the_documented_ollama_messages_are_what_ollama_takes():
    """A tool call and the tool message answering it by name, thinking on an assistant message:
    Ollama's adapter takes every documented key."""
    message = openapi.OLLAMA_CHAT["properties"]["messages"]["items"]
    messages = [{"role": "user", "content": "hi"},
                {"role": "assistant", "content": "", "thinking": "t",
                 "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]},
                {"role": "tool", "content": "ok", "tool_name": "f"}, {"role": "system", "content": "s", "images": None}]
    assert set(message["properties"]) == {key for m in messages for key in m}
    ignored = []
    out = ollama_api._messages(messages, thinking=False, ignored=ignored)
    assert out[2]["tool_call_id"] == out[1]["tool_calls"][0]["id"] and ignored == ["messages.thinking"]


def test_the_documented_anthropic_blocks_are_what_messages_takes():
    """A block of every documented type, with the keys the document gives it: the Messages
    adapter's own block check takes each."""
    block = openapi.MESSAGES["properties"]["system"]["oneOf"][1]["items"]
    examples = {"text": {"text": "x"}, "tool_use": {"id": "i", "name": "n", "input": {}},
                "thinking": {"thinking": "t", "signature": "s"}, "redacted_thinking": {"data": "d"},
                "tool_result": {"tool_use_id": "i", "content": "r", "is_error": False}}
    assert set(block["properties"]["type"]["enum"]) == set(examples)
    for kind, keys in examples.items():
        assert set(keys) <= set(block["properties"])
        assert anthropic_api._blocks([{"type": kind, **keys, "cache_control": {"type": "ephemeral"}}], "content")
