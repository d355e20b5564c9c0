"""GET /openapi.json: an OpenAPI 3.1 description of the HTTP API's routes.

A request body's fields are its API's field policy (protocol.FieldPolicy: every name the server
takes, so the document cannot drift from what the server accepts; any other field is refused by
name, with a 400), each described by a hand-written schema where its nested parts need one (the
messages, tools, blocks below), else by its typed request model's field (pydantic's JSON schema),
else by the policy: a hint's JSON types, a neutral field's values, a refused field's null. Enough
for a client generator, or a fuzzer such as schemathesis, to reach every route with requests it
takes; the APIs' own references have the rest.
Errors: 400 bad input, 401 missing token, 403 a foreign Host or Origin (no token set), 404,
411 / 413 / 415 the body's framing, size or type, 429 queue full, 501 not implemented, 503
loading or the ring down, 507 a rank out of memory."""

import copy
from importlib import metadata
from typing import Optional

from pydantic.json_schema import models_json_schema

from . import anthropic_api, ollama_api, openai_api, responses_api
from .chat_format import ROLES
from .protocol import FieldPolicy
from .tools import EMPTY_KEYS

_TEXT = {"type": "string"}
_NUMBER = {"type": "number"}
_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_OBJECT = {"type": "object"}
_STOP = {"oneOf": [_TEXT, {"type": "array", "items": _TEXT}]}
_SAMPLING = {"temperature": {"type": "number", "minimum": 0, "maximum": 2}, "top_p": {"type": "number", "minimum": 0, "maximum": 1},
             "top_k": {"type": "integer", "minimum": 0}, "seed": _INT, "stream": _BOOL}
_TEXT_PARTS = {"type": "array", "items": {"type": "object", "required": ["type", "text"],
                                          "properties": {"type": {"const": "text"}, "text": _TEXT}}}
_TOOL_CALL = {"type": "object", "required": ["type"], "properties": {
    "id": _TEXT, "type": {"enum": ["function", "custom"]},
    "function": {"type": "object", "required": ["name"], "properties": {"name": _TEXT, "arguments": {"oneOf": [_TEXT, _OBJECT]}}},
    "custom": {"type": "object", "required": ["name", "input"], "properties": {"name": _TEXT, "input": _TEXT}}}}
# What tools.chat_messages takes: a tool message answers a call by its id; only an assistant's carries calls.
_MESSAGE = {"type": "object", "required": ["role"], "additionalProperties": False, "properties": {
    "role": {"enum": list(ROLES)}, "content": {"oneOf": [_TEXT, _TEXT_PARTS, {"type": "null"}]}, "name": _TEXT,
    "tool_calls": {"type": "array", "items": _TOOL_CALL}, "tool_call_id": _TEXT, "reasoning_content": _TEXT,
    **{key: {"type": "null", "description": "accepted empty"} for key in EMPTY_KEYS}}}
_MESSAGES = {"type": "array", "minItems": 1, "items": _MESSAGE}
_FUNCTION_TOOL = {"type": "object", "required": ["type", "function"], "properties": {
    "type": {"const": "function"},
    "function": {"type": "object", "required": ["name"], "properties": {
        "name": _TEXT, "description": _TEXT, "parameters": _OBJECT}}}}

_COMPLETIONS = {"type": "object", "additionalProperties": False, "properties": {
    "model": _TEXT, "prompt": {"oneOf": [_TEXT, {"type": "array", "items": {"type": "integer", "minimum": 0}},
                                         {"type": "array", "items": _TEXT}]},
    "max_tokens": {"type": "integer", "minimum": 0}, "n": {"type": "integer", "minimum": 1}, "echo": _BOOL,
    "logprobs": {"type": "integer", "minimum": 0}, "stop": _STOP, "presence_penalty": _NUMBER,
    "frequency_penalty": _NUMBER, "user": _TEXT, **_SAMPLING}}
_CHAT = {"type": "object", "required": ["messages"], "additionalProperties": False, "properties": {
    "model": _TEXT, "messages": _MESSAGES, "max_tokens": {"type": "integer", "minimum": 1},
    "max_completion_tokens": {"type": "integer", "minimum": 1}, "n": {"type": "integer", "minimum": 1},
    "logprobs": _BOOL, "top_logprobs": {"type": "integer", "minimum": 0}, "stop": _STOP,
    "tools": {"type": "array", "items": _FUNCTION_TOOL},
    "tool_choice": {"oneOf": [{"enum": ["auto", "none", "required"]}, _OBJECT]}, "parallel_tool_calls": _BOOL,
    "response_format": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["text", "json_object", "json_schema"]}, "json_schema": _OBJECT}},
    "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
    "chat_template_kwargs": _OBJECT, "user": _TEXT, **_SAMPLING}}
_RESPONSES = {"type": "object", "required": ["input"], "additionalProperties": False, "properties": {
    "model": _TEXT, "input": {"oneOf": [_TEXT, {"type": "array", "items": _OBJECT}]}, "instructions": _TEXT,
    "max_output_tokens": {"type": "integer", "minimum": 1}, "tools": {"type": "array", "items": _OBJECT},
    "tool_choice": {"oneOf": [_TEXT, _OBJECT]}, "text": _OBJECT, "store": _BOOL,
    "temperature": _SAMPLING["temperature"], "top_p": _SAMPLING["top_p"], "stream": _BOOL}}
# A content block: its type and the keys anthropic_api.BLOCK_KEYS lets blocks of some type carry.
_BLOCK_KEY_TYPES = {"text": _TEXT, "id": _TEXT, "name": _TEXT, "input": _OBJECT, "thinking": _TEXT, "signature": _TEXT,
                    "data": _TEXT, "tool_use_id": _TEXT, "is_error": _BOOL}
_BLOCK = {"type": "object", "required": ["type"], "additionalProperties": False, "properties": {
    "type": {"enum": list(anthropic_api.BLOCK_KEYS)}, "cache_control": _OBJECT,
    **{key: _BLOCK_KEY_TYPES.get(key, {}) for keys in anthropic_api.BLOCK_KEYS.values() for key in keys}}}
_BLOCKS = {"oneOf": [_TEXT, {"type": "array", "items": _BLOCK}]}
_ANTHROPIC_PROMPT = {
    "model": _TEXT, "system": _BLOCKS,
    "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role", "content"], "additionalProperties": False,
        "properties": {"role": {"enum": ["user", "assistant"]}, "content": _BLOCKS}}},
    "tools": {"type": "array", "items": {"type": "object", "required": ["name", "input_schema"], "properties": {
        "name": _TEXT, "description": _TEXT, "input_schema": _OBJECT}}},
    "tool_choice": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["auto", "any", "tool", "none"]}, "name": _TEXT}},
    "thinking": {"type": "object", "required": ["type"], "properties": {
        "type": {"enum": ["enabled", "adaptive", "disabled"]}, "budget_tokens": _INT}}}
_MESSAGES_BODY = {"type": "object", "required": ["model", "max_tokens", "messages"], "additionalProperties": False,
            "properties": {**_ANTHROPIC_PROMPT, "max_tokens": {"type": "integer", "minimum": 1},
                           "stop_sequences": {"type": "array", "items": _TEXT},
                           **{k: v for k, v in _SAMPLING.items() if k != "seed"}}}  # Anthropic's API has no seed
_COUNT_TOKENS = {"type": "object", "required": ["model", "messages"], "additionalProperties": False,
                "properties": _ANTHROPIC_PROMPT}
_OLLAMA_OPTIONS = {"type": "object", "properties": {
    "temperature": _NUMBER, "top_p": _NUMBER, "top_k": _INT, "seed": _INT, "num_predict": _INT,
    "stop": {"type": "array", "items": _TEXT}, "repeat_penalty": _NUMBER}}
_OLLAMA = {"model": _TEXT, "stream": _BOOL, "format": {"oneOf": [{"const": "json"}, _OBJECT]},
           "options": _OLLAMA_OPTIONS, "keep_alive": {"oneOf": [_TEXT, _NUMBER]}, "think": _BOOL}
_OLLAMA_CHAT = {"type": "object", "required": ["model", "messages"], "additionalProperties": False, "properties": {
    **_OLLAMA, "messages": {"type": "array", "minItems": 1, "items": {
        "type": "object", "required": ["role"], "additionalProperties": False, "properties": {  # ollama_api._messages
            "role": {"enum": ["system", "user", "assistant", "tool"]}, "content": _TEXT, "thinking": _TEXT,
            "tool_calls": {"type": "array", "items": {"type": "object", "required": ["function"], "properties": {
                "function": {"type": "object", "required": ["name"], "properties": {"name": _TEXT, "arguments": _OBJECT}}}}},
            "tool_name": _TEXT, "images": {"type": "null", "description": "refused unless empty: a text-only model"}}}},
    "tools": {"type": "array", "items": _FUNCTION_TOOL}}}
_OLLAMA_GENERATE = {"type": "object", "required": ["model", "prompt"], "additionalProperties": False, "properties": {
    **_OLLAMA, "prompt": {"type": "string", "minLength": 1}, "system": _TEXT, "raw": _BOOL}}
_OLLAMA_SHOW = {"type": "object", "additionalProperties": False, "properties": {"model": _TEXT, "name": _TEXT}}
_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", dict: "object", list: "array",
               type(None): "null"}


# The typed request models' JSON schemas, their parts (parts.py and each API's) under
# components/schemas, named apart where two APIs' parts share a class name.
_MODELS = (openai_api.CompletionRequest, openai_api.ChatRequest, responses_api.ResponsesRequest,
           anthropic_api.MessagesRequest, ollama_api.OllamaChat, ollama_api.OllamaGenerate)
_REFS, _SCHEMAS = models_json_schema([(m, "validation") for m in _MODELS], ref_template="#/components/schemas/{model}")
_SCHEMAS = _SCHEMAS["$defs"]


def body_schema(written: dict, policy: FieldPolicy, model: Optional[type] = None) -> dict:
    """A request body's schema: `written` (the hand-written one: its required fields and the
    properties it describes) with every other field `policy` takes, described by `model`'s typed
    field where it has one (its parts by reference), else by the policy."""
    typed = _SCHEMAS[_REFS[model, "validation"]["$ref"].rsplit("/", 1)[1]]["properties"] if model is not None else {}
    properties = {}
    for name in policy.accepted:
        properties[name] = {k: v for k, v in typed.get(name, {}).items() if k != "title"}
    for name, kinds in policy.hints.items():
        properties[name] = {"description": "accepted; changes nothing here (named in the access log)",
                            **({"type": [_JSON_TYPES[k] for k in kinds] + ["null"]} if kinds else {})}
    for name, (values, why) in policy.neutral.items():
        properties[name] = {"enum": [None, *values], "description": f"only these values: {why}"}
    for name, why in policy.refused.items():
        properties[name] = {"type": "null", "description": f"refused unless null: {why}"}
    properties.update(written["properties"])
    return {**written, "additionalProperties": False, "properties": properties}


COMPLETIONS = body_schema(_COMPLETIONS, openai_api.POLICIES["completions"], openai_api.CompletionRequest)
CHAT = body_schema(_CHAT, openai_api.POLICIES["chat"], openai_api.ChatRequest)
RESPONSES = body_schema(_RESPONSES, responses_api.POLICY, responses_api.ResponsesRequest)
MESSAGES = body_schema(_MESSAGES_BODY, anthropic_api.POLICY, anthropic_api.MessagesRequest)
COUNT_TOKENS = body_schema(_COUNT_TOKENS, anthropic_api.COUNT_POLICY, anthropic_api.MessagesRequest)
OLLAMA_CHAT = body_schema(_OLLAMA_CHAT, ollama_api.POLICIES[True], ollama_api.OllamaChat)
OLLAMA_GENERATE = body_schema(_OLLAMA_GENERATE, ollama_api.POLICIES[False], ollama_api.OllamaGenerate)
OLLAMA_SHOW = body_schema(_OLLAMA_SHOW, ollama_api.SHOW_POLICY)
OLLAMA_MANAGEMENT = {"type": "object"}

_ERRORS = {"400": "bad input (the message names the field)", "401": "missing or wrong token",
           "403": "a foreign Host or Origin (no --auth-token)", "404": "no such model", "411": "no Content-Length",
           "413": "the body is over 16 MiB", "415": "the body is not application/json", "429": "the queue is full",
           "503": "loading, or the pipeline is down", "507": "a rank had no memory for the request"}

# (method, path) -> (summary, request body schema or None, content type of a 200, its schema)
ROUTES = {
    ("get", "/health"): ("Health: 200 serving, 503 otherwise (no token needed)", None, "application/json", _OBJECT),
    ("get", "/metrics"): ("Prometheus metrics", None, "text/plain", _TEXT),
    ("get", "/v1/status"): ("The server's state: ranks, requests, recent figures", None, "application/json", _OBJECT),
    ("get", "/"): ("The status page", None, "text/html", _TEXT),
    ("get", "/chat"): ("The chat page", None, "text/html", _TEXT),
    ("get", "/openapi.json"): ("This document", None, "application/json", _OBJECT),
    ("get", "/v1/models"): ("The model served (OpenAI)", None, "application/json", _OBJECT),
    ("post", "/v1/completions"): ("Completions (OpenAI)", COMPLETIONS, "application/json", _OBJECT),
    ("post", "/v1/chat/completions"): ("Chat completions (OpenAI)", CHAT, "application/json", _OBJECT),
    ("post", "/v1/responses"): ("Responses (OpenAI)", RESPONSES, "application/json", _OBJECT),
    ("post", "/v1/messages"): ("Messages (Anthropic)", MESSAGES, "application/json", _OBJECT),
    ("post", "/v1/messages/count_tokens"): ("Prompt tokens of a Messages request (Anthropic)", COUNT_TOKENS,
                                            "application/json", _OBJECT),
    ("get", "/api/version"): ("Version (Ollama)", None, "application/json", _OBJECT),
    ("get", "/api/tags"): ("Models (Ollama)", None, "application/json", _OBJECT),
    ("get", "/api/ps"): ("Loaded models (Ollama)", None, "application/json", _OBJECT),
    ("post", "/api/show"): ("A model's facts (Ollama)", OLLAMA_SHOW, "application/json", _OBJECT),
    ("post", "/api/chat"): ("Chat (Ollama), streamed as NDJSON unless stream is false", OLLAMA_CHAT,
                            "application/json", _OBJECT),
    ("post", "/api/generate"): ("Generate (Ollama), streamed as NDJSON unless stream is false", OLLAMA_GENERATE,
                                "application/json", _OBJECT),
    **{("post", path): ("Not supported here: 501 (Ollama's model management, embeddings)", OLLAMA_MANAGEMENT,
                        "application/json", _OBJECT)
       for path in ("/api/pull", "/api/push", "/api/create", "/api/copy", "/api/embed", "/api/embeddings")},
}
STREAMED = ("/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/messages", "/api/chat", "/api/generate")


def document() -> dict:
    """The OpenAPI document (a fresh copy: callers may change it)."""
    paths = {}
    for (method, path), (summary, body, content_type, schema) in ROUTES.items():
        responses = {"200": {"description": "OK", "content": {content_type: {"schema": schema}}}}
        if path in STREAMED:
            responses["200"]["content"]["text/event-stream"] = {"schema": _TEXT}
            responses["200"]["content"]["application/x-ndjson"] = {"schema": _TEXT}
        if path.endswith(("/pull", "/push", "/create", "/copy", "/embed", "/embeddings")):
            responses = {"501": {"description": "not supported", "content": {"application/json": {"schema": _OBJECT}}}}
        for code, why in _ERRORS.items():
            if body is None and code in ("411", "413", "415", "429", "507"):
                continue
            responses.setdefault(code, {"description": why, "content": {"application/json": {"schema": _OBJECT}}})
        operation = {"summary": summary, "operationId": f"{method}_{path.strip('/').replace('/', '_') or 'root'}",
                     "responses": responses}
        if path not in ("/health", "/", "/chat", "/openapi.json"):
            operation["security"] = [{"bearer": []}, {}]
        if body is not None:
            operation["requestBody"] = {"required": True, "content": {"application/json": {"schema": body}}}
        paths.setdefault(path, {})[method] = operation
    try:
        version = metadata.version("trinity-pipeline")
    except metadata.PackageNotFoundError:
        version = "0"
    return copy.deepcopy({
        "openapi": "3.1.0",
        "info": {"title": "trinity-pipeline", "version": version,
                 "description": "OpenAI-, Anthropic- and Ollama-compatible HTTP API of a trinity-pipeline server"},
        "paths": paths,
        "components": {"securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}, "schemas": _SCHEMAS},
    })
