"""What a Messages API client gets back (anthropic_api.py takes its requests): the Message,
or its server-sent events, made from the OpenAI reply of its one choice. Where the checkpoint
thinks (think tokens), the reasoning comes first as a `thinking` block (streamed as
thinking_delta; its `signature` is empty: nothing here signs or checks one)."""

import json

from .api_adapter import sse


def _usage(usage: dict) -> dict:
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    return {"input_tokens": usage["prompt_tokens"] - cached, "output_tokens": usage["completion_tokens"],
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


def _tool_use(call: dict) -> dict:
    arguments = call["function"]["arguments"]
    return {"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"), "name": call["function"]["name"],
            "input": json.loads(arguments) if arguments else {}}


def _thinking(text: str) -> dict:
    return {"type": "thinking", "thinking": text, "signature": ""}


class MessageReply:
    """The Message (or its events) made from the OpenAI reply of its one choice."""

    content_type = "text/event-stream"

    def __init__(self, reply, body: dict):
        self.reply = reply
        self.id = "msg_" + reply.id.split("-", 1)[1]
        self.blocks = 0  # blocks started
        self.open = None  # the type of the last one while it is not stopped

    def _message(self, content: list, stop_reason, stop_sequence, usage: dict) -> dict:
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.reply.model, "content": content,
                "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": usage}

    def _stop_reason(self, finish: str):
        """(stop_reason, stop_sequence) of an OpenAI finish reason."""
        if finish == "tool_calls":
            return "tool_use", None
        if finish == "length":
            return "max_tokens", None
        hit = self.reply.choices[0].stop_sequence  # the runtime names the stop string that ended it
        return ("stop_sequence", hit) if hit else ("end_turn", None)

    def whole(self, openai_whole: dict) -> dict:
        choice = openai_whole["choices"][0]
        message = choice["message"]
        content = [_thinking(message["reasoning_content"])] if message.get("reasoning_content") else []
        content += [{"type": "text", "text": message["content"]}] if message["content"] else []
        content += [_tool_use(call) for call in message.get("tool_calls") or []]
        return self._message(content, *self._stop_reason(choice["finish_reason"]), _usage(openai_whole["usage"]))

    def _start(self, block: dict) -> list:
        frames = self._stop()
        frames.append(sse("content_block_start", {"type": "content_block_start", "index": self.blocks,
                                                  "content_block": block}))
        self.blocks, self.open = self.blocks + 1, block["type"]
        return frames

    def _delta(self, delta: dict) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})

    def _stop(self) -> list:
        if not self.open:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]

    def opening(self, chunks) -> list:
        """message_start (the prompt's tokens; what the cache restored comes in message_delta) and a ping."""
        usage = {"input_tokens": len(self.reply.plan.requests[0].prompt_ids), "output_tokens": 0,
                 "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        return [sse("message_start", {"type": "message_start", "message": self._message([], None, None, usage)}),
                sse("ping", {"type": "ping"})]

    def add(self, chunks) -> list:
        frames = []
        for chunk in chunks:
            delta = chunk["choices"][0]["delta"]
            if delta.get("reasoning_content"):
                if self.open != "thinking":
                    frames += self._start(_thinking(""))
                frames.append(self._delta({"type": "thinking_delta", "thinking": delta["reasoning_content"]}))
            if delta.get("content"):
                if self.open != "text":
                    frames += self._start({"type": "text", "text": ""})
                frames.append(self._delta({"type": "text_delta", "text": delta["content"]}))
            for call in delta.get("tool_calls") or []:  # each call comes whole
                block = _tool_use(call)
                frames += self._start({**block, "input": {}})
                frames.append(self._delta({"type": "input_json_delta", "partial_json": json.dumps(block["input"])}))
                frames += self._stop()
        return frames

    def closing(self) -> list:
        choice = self.reply.choices[0]
        stop_reason, stop_sequence = self._stop_reason(choice.finish)
        return self._stop() + [
            sse("message_delta", {"type": "message_delta",
                                  "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                  "usage": _usage(self.reply.usage())}),
            sse("message_stop", {"type": "message_stop"})]

    def failure(self, error_body: dict) -> bytes:
        return sse("error", error_body)
