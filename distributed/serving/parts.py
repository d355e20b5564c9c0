"""A request's nested parts (messages, content blocks, tools), typed as TypedDicts, as vLLM types
OpenAI's messages: pydantic checks their JSON types where the body is parsed (protocol.parse), and
they stay the dicts that chat templates and the adapters read. A part's keys are `closed` (any other
is a 400 naming it) or `open_keys` (others pass; the part's reader checks what it must).

Here: the parts of a chat request in OpenAI's form (ChatRequest.messages, .tools, .tool_choice,
.response_format), which every API's chat becomes (tools.py reads them). Each other API types its
own parts in its module."""

from typing import Any, List, Optional, Union

from pydantic import ConfigDict, with_config
from typing_extensions import Required, TypedDict

closed = with_config(ConfigDict(extra="forbid", strict=True))  # strict: JSON types as they are
open_keys = with_config(ConfigDict(extra="allow", strict=True))


@open_keys
class ContentPart(TypedDict, total=False):
    type: Required[str]  # "text" only (_text names another)
    text: str


@open_keys
class FunctionCall(TypedDict, total=False):
    name: Required[str]
    arguments: Union[str, dict]  # JSON text, or (as templates take it) decoded


@open_keys
class CustomCall(TypedDict):
    name: str
    input: str


@open_keys
class CallItem(TypedDict, total=False):
    """An assistant message's tool call: a function's, or a custom tool's (`custom`)."""

    id: str
    type: str
    function: FunctionCall
    custom: CustomCall


@closed
class Message(TypedDict, total=False):
    role: Required[str]
    content: Union[str, List[ContentPart], None]
    name: Optional[str]
    tool_calls: Optional[List[CallItem]]
    tool_call_id: Optional[str]
    reasoning_content: Optional[str]  # an earlier reply's reasoning (where the tokenizer thinks)
    refusal: Any  # EMPTY_KEYS: sent back with earlier replies, taken empty
    audio: Any
    function_call: Any
    annotations: Any


@open_keys
class FunctionSpec(TypedDict, total=False):
    name: Required[str]
    description: Optional[str]
    parameters: Optional[dict]
    strict: Optional[bool]


@closed
class Grammar(TypedDict):
    syntax: str  # "lark" or "regex"
    definition: str


@open_keys
class CustomFormat(TypedDict, total=False):
    type: Required[str]  # "text" or "grammar"
    grammar: Grammar


@closed
class CustomSpec(TypedDict, total=False):
    name: Required[str]
    description: Optional[str]
    format: Optional[CustomFormat]


@open_keys
class Tool(TypedDict, total=False):
    """A function tool, or a custom (free-form) one: its keys are checked by request_tools."""

    type: Required[str]
    function: FunctionSpec
    custom: CustomSpec


@open_keys
class NamedTool(TypedDict, total=False):
    """tool_choice as an object: a named function or custom tool, or allowed_tools (constraints.py)."""

    type: Required[str]


ToolChoice = Union[str, NamedTool]


@closed
class JsonSchemaSpec(TypedDict, total=False):
    name: str
    schema: dict
    strict: Optional[bool]
    description: Optional[str]


@closed
class ResponseFormat(TypedDict, total=False):
    type: Required[str]  # text, json_object or json_schema (constraints.response_grammar)
    json_schema: JsonSchemaSpec
