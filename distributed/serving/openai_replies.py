"""The JSON an OpenAI client gets back: completions and chat completions, whole or
as stream chunks, built from the scheduler's events, one Choice per generation.

Logprobs follow OpenAI's two formats: completions' (`tokens`, `token_logprobs`,
`top_logprobs` as {token: logprob} holding the top N and the chosen token,
`text_offset`; with `echo`, the prompt's tokens come first and the first one has
null logprobs, as OpenAI and vLLM answer) and chat's (`content`: a list of
{token, logprob, bytes, top_logprobs}).

Chat replies are split by reply_split.py: where the checkpoint thinks, the reasoning
comes in `reasoning_content` (the message's, and streamed deltas', as vLLM and
DeepSeek send it) and usage counts its tokens (`completion_tokens_details`).
"""

import time
import uuid
from typing import List, Optional

from ..runtime.request import PromptEvent, TokenEvent
from .openai_fields import Plan
from .reply_split import ReplySplitter, reply_prompt


class Entry:
    """One token's logprobs: its id, logprob (None: the first prompt token), alternatives, text offset."""

    __slots__ = ("token_id", "logprob", "top", "offset")

    def __init__(self, token_id: int, logprob: Optional[float], top, offset: int):
        self.token_id, self.logprob, self.top, self.offset = token_id, logprob, top, offset


class Choice:
    """One generation's state as its events arrive; each step returns stream chunks."""

    def __init__(self, reply: "Reply", index: int, echo: Optional[str], scored: bool):
        self.reply, self.index, self.echo = reply, index, echo
        request = reply.plan.requests[index]
        prompt = request.prompt_ids if reply.plan.lazy else reply_prompt(request)  # a lazy grammar binds later
        # chat: the reply split into reasoning, content and tool calls (completions are text as it comes)
        self.split = ReplySplitter(reply.tokenizer, reply.plan.tools, prompt) if reply.plan.chat else None
        self.echo_waits = echo is not None and scored  # the echo goes out with the prompt's logprobs
        self.text, self.reasoning, self.entries, self.calls = [], [], [], []
        self.reasoning_tokens = 0  # tokens generated while the reply was reasoning (their </think> too)
        self.offset = 0  # text_offset of the next entry
        self.finish = self.error = self.stop_sequence = None
        self.usage = (0, 0, 0)  # prompt, completion and cached tokens

    def opening(self) -> List[dict]:
        """Chunks before any event: chat's role, or the echoed prompt."""
        if self.reply.plan.chat:
            return [self._chunk({"delta": {"role": "assistant", "content": ""}})]
        if self.echo is not None and not self.echo_waits:
            return self._text(self.echo, [])
        return []

    def add(self, event) -> List[dict]:
        """Take one event; returns the chunks it makes."""
        logprobs = self.reply.plan.logprobs is not None
        if isinstance(event, PromptEvent):
            entries = [self._entry(*e) for e in zip(event.token_ids, event.logprobs, event.top_logprobs)] \
                if logprobs and self.echo is not None else []
            return self._text(self.echo or "", entries) if self.echo_waits else []
        if isinstance(event, TokenEvent):
            entries = [self._entry(event.token_id, event.logprob, event.top_logprobs or [])] if logprobs else []
            self.reasoning_tokens += self.split is not None and self.split.state == "reasoning"
            return self._text(event.text, entries)
        self.error = event.error if event.finish_reason == "error" else None
        self.stop_sequence = event.stop_sequence  # the Messages API names it
        self.usage = (event.prompt_tokens, event.completion_tokens, event.cached_tokens)
        chunks = self._text(event.text, [])
        reasoning, tail, calls = self.split.finish() if self.split else ("", "", [])
        self.finish = "length" if event.finish_reason == "length" else "stop"  # "cancelled": nobody listens
        if self.calls or calls:
            self.finish = "tool_calls" if self.finish == "stop" else self.finish
        return chunks + self._content(tail, calls, [], self.finish, reasoning)

    def _entry(self, token_id: int, logprob: Optional[float], top) -> Entry:
        """Offsets add up the tokens' own texts, from the choice's start (as vLLM counts them)."""
        entry = Entry(token_id, logprob, top, self.offset)
        self.offset += len(self.reply.token(token_id))
        return entry

    def _text(self, text: str, entries: List[Entry]) -> List[dict]:
        calls, reasoning = [], ""
        if self.split is not None:
            reasoning, text, calls = self.split.feed(text)
        return self._content(text, calls, entries, None, reasoning)

    def _content(self, text: str, calls: List[dict], entries: List[Entry], finish, reasoning: str = "") -> List[dict]:
        self.text.append(text)
        self.reasoning.append(reasoning)
        self.entries += entries
        self.calls += calls
        if not (text or calls or entries or finish or reasoning):
            return []
        if not self.reply.plan.chat:
            return [self._chunk({"text": text}, entries, finish)]
        delta = {**({"reasoning_content": reasoning} if reasoning else {}), **({"content": text} if text else {}),
                 **({"tool_calls": calls} if calls else {})}
        return [self._chunk({"delta": delta}, entries, finish)]

    def _chunk(self, part: dict, entries=(), finish=None) -> dict:
        """One stream chunk: `part` is the choice's text (completions) or delta (chat)."""
        choice = {"index": self.index, **part, "logprobs": self.reply.logprobs(entries) if entries else None,
                  "finish_reason": finish}
        return self.reply.frame("chat.completion.chunk" if self.reply.plan.chat else "text_completion", [choice])

    def whole(self) -> dict:
        text = "".join(self.text)
        out = {"index": self.index}
        if self.reply.plan.chat:
            calls = [{k: v for k, v in c.items() if k != "index"} for c in self.calls]
            reasoning = "".join(self.reasoning)
            out["message"] = {"role": "assistant", "content": text if text or not calls else None,
                              **({"tool_calls": calls} if calls else {}), "refusal": None,
                              **({"reasoning_content": reasoning or None} if self.split.thinks else {})}
        else:
            out["text"] = text
        return {**out, "logprobs": self.reply.logprobs(self.entries), "finish_reason": self.finish}


class Reply:
    """A completion's choices and the frames around them."""

    def __init__(self, plan: Plan, model: str, tokenizer):
        self.plan, self.model, self.tokenizer = plan, model, tokenizer
        self.id = ("chatcmpl-" if plan.chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self._tokens = {}
        self.choices = [Choice(self, i, echo, r.prompt_logprobs)
                        for i, (echo, r) in enumerate(zip(plan.echo or [None] * len(plan.requests), plan.requests))]

    @property
    def error(self) -> Optional[str]:
        return next((c.error for c in self.choices if c.error), None)

    def frame(self, kind: str, choices: List[dict]) -> dict:
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": choices}

    def usage(self) -> dict:
        firsts = {}  # a prompt counts once, however many choices it has
        for prompt, choice in zip(self.plan.prompts, self.choices):
            firsts.setdefault(prompt, choice)
        prompt = sum(c.usage[0] for c in firsts.values())
        completion = sum(c.usage[1] for c in self.choices)
        out = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
               "prompt_tokens_details": {"cached_tokens": sum(c.usage[2] for c in firsts.values())}}
        if self.plan.chat and self.tokenizer.has_thinking:  # OpenAI's reasoning models count them so
            out["completion_tokens_details"] = {"reasoning_tokens": sum(c.reasoning_tokens for c in self.choices)}
        return out

    def whole(self) -> dict:
        kind = "chat.completion" if self.plan.chat else "text_completion"
        return {**self.frame(kind, [c.whole() for c in self.choices]), "usage": self.usage()}

    def usage_chunk(self) -> dict:
        kind = "chat.completion.chunk" if self.plan.chat else "text_completion"
        return {**self.frame(kind, []), "usage": self.usage()}

    def token(self, token_id: int) -> str:
        """A token's own text (cached: each reply decodes the same few ids again and again)."""
        text = self._tokens.get(token_id)
        if text is None:
            text = self._tokens[token_id] = self.tokenizer.decode([token_id])
        return text

    def logprobs(self, entries) -> Optional[dict]:
        if self.plan.logprobs is None:
            return None
        if self.plan.chat:
            def item(token_id, logprob):
                token = self.token(token_id)
                return {"token": token, "logprob": logprob, "bytes": list(token.encode())}

            return {"content": [{**item(e.token_id, e.logprob), "top_logprobs": [item(i, v) for i, v in e.top or []]}
                                for e in entries], "refusal": None}
        tokens = [self.token(e.token_id) for e in entries]
        tops = []
        for token, e in zip(tokens, entries):
            if e.top is None:
                tops.append(None)  # the first prompt token
            else:
                top = {self.token(i): v for i, v in e.top}
                top.setdefault(token, e.logprob)  # OpenAI: the chosen token is always there
                tops.append(top)
        return {"tokens": tokens, "token_logprobs": [e.logprob for e in entries], "top_logprobs": tops,
                "text_offset": [e.offset for e in entries]}
