"""What an API served over chat completions' request path provides (http_api.ADAPTERS lists
them): the Responses, Messages and Ollama APIs. One path for all: the same chat
template, sampling, constraints, prefix cache, metrics, access log, cancellation and
queue bound as /v1/chat/completions (http_api.py runs it), so the same greedy message
gives the same text through every API.

An Adapter is
- `to_chat(body, info, tokenizer) -> dict`: the API's body as an OpenAI chat-completions
  body (or a completions one: a body with "prompt" and no "messages"), including
  "stream"; RequestError / ApiError name the API's own fields;
- `reply(openai_reply, body) -> AdaptedReply`: what the client gets, made from the
  OpenAI reply (openai_api.Completion) of its one choice;
- `param(name) -> str`: the API's name for a chat-completions field an error names.

An AdaptedReply has
- `content_type`: of the stream ("text/event-stream", "application/x-ndjson");
- `opening(chunks) -> [bytes]`: the stream's first frames (`chunks`: the OpenAI
  chunks of Choice.opening());
- `add(chunks) -> [bytes]`: the frames for the OpenAI chunks one event made
  (Choice.add(event): reasoning, text and tool-call deltas, the finish);
- `closing() -> [bytes]`: the last frames, after the finish;
- `failure(error_body) -> bytes`: the frame that ends a stream whose generation failed;
- `whole(openai_whole) -> dict`: the non-streamed answer, from Reply.whole().

Frames are whole: an SSE event (sse()) or an NDJSON line (ndjson()).
"""

import json
from dataclasses import dataclass
from typing import Callable


@dataclass(frozen=True)
class Adapter:
    to_chat: Callable
    reply: Callable
    param: Callable = lambda name: name


def sse(event: str, data: dict) -> bytes:
    """One server-sent event with a name (as the Responses and Messages APIs send them)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def ndjson(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"
