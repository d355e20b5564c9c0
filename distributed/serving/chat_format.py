"""The model's chat format, both ways, for every front end (gRPC, the HTTP APIs, --chat): a
client's prompt, token ids or chat messages plus sampling fields into a validated
GenerationRequest (the chat template applied), the generated text back into reasoning, content
and tool calls (ReplySplitter), and the model facts the front ends report (ModelInfo). System messages after the first turn
stay where they stand for any template (place_system: the Messages and Responses adapters).

The reply is split as it streams, as mlx-lm's server splits it: one TextStateMachine
(mlx_lm.generate) whose states are "normal" (content), "reasoning" (between the tokenizer's think_start and think_end,
where its TokenizerWrapper found think tokens: `has_thinking`) and "tool" (between
tool_call_start and tool_call_end, where the tool parser mlx-lm found for the
tokenizer, json_tools, qwen3_coder, ..., parses each call). The markers themselves
are stripped. A prompt that ends inside an open think (the chat template's generation
prompt opened it, as Trinity-Thinking's and Qwen3's do) starts in "reasoning".

Whitespace after a call (the template's newline after </tool_call>) is held back until text
follows it, and dropped if none does: a reply of calls has no content. A call the generation
cut short (max_tokens inside it) is dropped, never shown as its raw markup; the finish
reason ("length") tells the client the reply was cut.
"""

import json
import uuid
import weakref
from dataclasses import dataclass, field
from typing import Dict, List, NamedTuple, Optional, Sequence

from jinja2 import TemplateError

from ..runtime.request import GenerationRequest, RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")  # chat roles a request may use
SYSTEM_ROLES = ("system", "developer")  # "developer": OpenAI's newer name for "system"


@dataclass
class ModelInfo:
    model_id: str
    vocab_size: int
    max_context: int
    max_tokens_cap: int
    ranks: List[dict] = field(default_factory=list)  # as in run_trinity.py --json
    max_batch: int = 0  # sequences decoding together
    kv_bits: Optional[int] = None  # --kv-bits: the full-attention caches' bits (None: whole)


def prompt_ids(
    tokenizer,
    prompt: Optional[str] = None,
    token_ids: Optional[Sequence[int]] = None,
    messages: Optional[List[Dict[str, str]]] = None,
    chat_template: bool = False,
) -> List[int]:
    """Exactly one of prompt / token_ids / messages. Messages always get the chat
    template; a plain prompt gets it only if `chat_template`."""
    given = [name for name, v in (("prompt", prompt), ("token_ids", token_ids), ("messages", messages)) if v]
    if len(given) != 1:
        what = "none" if not given else " and ".join(given)
        raise RequestError("prompt", f"give exactly one of prompt, token_ids or messages (got {what})")
    if token_ids:
        return [int(t) for t in token_ids]
    if messages:
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise RequestError("messages", f"message {i} needs string 'role' and 'content'")
            check_role(i, m["role"])
        return chat_ids(tokenizer, messages)
    if chat_template and tokenizer.chat_template is not None:
        return chat_ids(tokenizer, [{"role": "user", "content": prompt}])
    # As mlx-lm does for raw prompts: the tokenizer adds its BOS, if it has one.
    return list(tokenizer.encode(prompt))


def check_role(i: int, role: str) -> None:
    if role not in ROLES:
        raise RequestError(f"messages[{i}].role", f"unknown role {role!r} (expected one of {', '.join(ROLES)})")


def chat_ids(tokenizer, messages: List[dict], tools: Optional[List[dict]] = None,
             template_kwargs: Optional[dict] = None) -> List[int]:
    """The chat template applied to `messages` (roles checked), with `tools` if given and the
    template's own variables (`template_kwargs`, e.g. enable_thinking)."""
    # "developer" is OpenAI's newer name for "system"; chat templates know the latter.
    messages = [{**m, "role": "system"} if m["role"] == "developer" else m for m in messages]
    try:
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                            **({"tools": tools} if tools else {}), **(template_kwargs or {}))
    except TemplateError as e:  # e.g. a template that raises on a role order it does not take
        raise RequestError("messages", f"the chat template refused them: {e}") from None
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


_later_system = weakref.WeakKeyDictionary()  # tokenizer -> how its template takes a later system message
PROBE = ("Qz1first", "Qz2reply", "Qz3later", "Qz4next")  # the probe's turns (no whitespace: a template may trim)


def _in_order(tokenizer, roles) -> bool:
    """Whether the chat template renders PROBE's texts in these roles, each once and in order."""
    probe = [{"role": role, "content": text} for role, text in zip(roles, PROBE)]
    try:
        text = tokenizer.apply_chat_template(probe, add_generation_prompt=True, tokenize=False)
    except (TemplateError, ValueError, TypeError):
        return False
    at = [text.find(mark) for mark in PROBE]
    return all(text.count(mark) == 1 for mark in PROBE) and at == sorted(at)


def later_system_mode(tokenizer) -> str:
    """How a system message after the first turn reaches this chat template: "system" where it
    renders one where it stands; else as a user turn there ("user"), or where the template takes
    no two user turns in a row, "merge": joined to the user turn beside it. A template that
    refuses one, drops it, or moves it to the top (which would rewrite the prompt's beginning at
    every turn that adds one) gets it as user text."""
    try:
        return _later_system[tokenizer]
    except (KeyError, TypeError):
        pass
    if _in_order(tokenizer, ("user", "assistant", "system", "user")):
        mode = "system"
    else:
        mode = "user" if _in_order(tokenizer, ("user", "assistant", "user", "user")) else "merge"
    try:
        _later_system[tokenizer] = mode
    except TypeError:
        pass
    return mode


def place_system(messages: list, tokenizer) -> list:
    """System entries among the turns (Claude Code's mid-conversation system messages) stay where
    they stand, so that each turn's prompt extends the one before: a system message where the chat
    template renders one there, else a user turn at their place (joined to the user turn beside it,
    the one before first, where the template takes no two in a row). Where it does not render them,
    system messages before the first turn are joined into one, the system prompt."""
    later = [i for i, m in enumerate(messages) if m["role"] in SYSTEM_ROLES
             and any(x["role"] not in SYSTEM_ROLES for x in messages[:i])]
    head = next((i for i, m in enumerate(messages) if m["role"] not in SYSTEM_ROLES), len(messages))
    if (not later and head < 2) or tokenizer is None:
        return messages
    mode = later_system_mode(tokenizer)
    if mode == "system":
        return messages
    out = [{"role": "system", "content": "\n\n".join(m["content"] for m in messages[:head])}] if head else []
    joined = set()  # indices in `out` of user turns that carry a system entry
    for i, m in enumerate(messages[head:], head):
        if i not in later:
            if mode == "merge" and m["role"] == "user" and out and len(out) - 1 in joined:
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
            else:
                out.append(m)
            continue
        if mode == "merge" and out and out[-1]["role"] == "user":
            out[-1] = {**out[-1], "content": out[-1]["content"] + "\n\n" + m["content"]}
        else:
            out.append({"role": "user", "content": m["content"]})
        joined.add(len(out) - 1)
    return out


def build_request(info: ModelInfo, ids: List[int], **sampling) -> GenerationRequest:
    """A validated request; raises RequestError naming the bad field."""
    request = GenerationRequest(prompt_ids=ids, **sampling)
    request.validate(info.vocab_size, info.max_context, info.max_tokens_cap)
    return request


class Split(NamedTuple):
    reasoning: str
    content: str
    calls: List[dict]


def reply_prompt(request):
    """The prompt whose end decides where a request's reply starts: none for a constrained one,
    whose grammar holds from its first token (the reply is all answer, even after an open think)."""
    return request.prompt_ids if request.grammar is None else None


def prompt_opens_reasoning(tokenizer, prompt_ids) -> bool:
    """Whether the prompt ends inside an open think (mlx-lm's server's test)."""
    if not getattr(tokenizer, "has_thinking", False) or not prompt_ids:
        return False
    ids = list(prompt_ids)
    return tokenizer.rfind_think_start(ids) > tokenizer.rfind_think_end(ids)


class ReplySplitter:
    """feed(text) -> Split of what can be shown now; finish() -> what was held back."""

    def __init__(self, tokenizer, tools: Optional[List[dict]] = None, prompt_ids=None):
        self.tools, self.parser = tools, tokenizer.tool_parser if tools else None
        self.start, self.end = tokenizer.tool_call_start, tokenizer.tool_call_end
        self.thinks = bool(getattr(tokenizer, "has_thinking", False))
        transitions = {"normal": []}
        if self.thinks:
            transitions["normal"].append((tokenizer.think_start, "reasoning"))
            transitions["reasoning"] = [(tokenizer.think_end, "normal")]
        if tools:
            transitions["normal"].append((self.start, "tool"))
            transitions["tool"] = [(self.end, "normal")] if self.end else []
        from mlx_lm.generate import TextStateMachine  # its module imports transformers: rank 0 alone gets here

        self._machine = TextStateMachine
        self._sm = TextStateMachine(transitions) if self.thinks or tools else None
        initial = "reasoning" if prompt_opens_reasoning(tokenizer, prompt_ids) else "normal"
        self._state = self._sm.make_state(initial) if self._sm else None
        self._call = ""  # text of the call being generated
        self.count = 0  # calls parsed so far
        self._blank = ""  # whitespace after a call, held until text follows it

    @property
    def state(self) -> str:
        """"normal", "reasoning" or "tool": where the text fed so far has left the reply."""
        return self._state[0] if self._state else "normal"

    def feed(self, text: str) -> Split:
        """New generated text -> what to show of it now (a marker's possible start is held back)."""
        if self._sm is None:
            return Split("", text, [])
        self._state, segments = self._machine.split(self._state, text)
        return self._take(segments, final=False)

    def finish(self) -> Split:
        """The end of the generation: what was held back, and a call left open."""
        if self._sm is None:
            return Split("", "", [])
        self._state, held, state = self._machine.flush(self._state)
        return self._take([(state, held)], final=True)

    def _take(self, segments, final: bool) -> Split:
        reasoning, content, calls = [], [], []
        for i, (state, text) in enumerate(segments):
            if state == "reasoning":
                reasoning.append(text)
            if state == "tool":
                self._call += text
                if not final:
                    continue
            closed = state != "tool" and i > 0 and segments[i - 1][0] == "tool"
            if closed or (final and state == "tool"):  # a call ended, or the generation did inside one
                parsed = self._parse(self._call) if self._call.strip() else None
                if parsed is None and closed:  # not a call after all: show it as text
                    content.append(self.start + self._call + self.end)
                calls += parsed or []  # a call cut short is dropped: the finish reason says it was cut
                self._call = ""
            if state == "normal":
                if self.count and not (text.strip() or final):
                    self._blank += text  # after a call: shown only if text follows
                    continue
                if text.strip():
                    content.append(self._blank)
                self._blank = ""
                content.append(text if text.strip() or not self.count else "")
        return Split("".join(reasoning), "".join(content), calls)

    def _parse(self, text: str) -> Optional[List[dict]]:
        try:
            parsed = self.parser(text, self.tools)
        except (ValueError, KeyError, TypeError, AttributeError):
            return None
        calls = []
        for call in parsed if isinstance(parsed, list) else [parsed]:
            if not isinstance(call, dict) or not isinstance(call.get("name"), str):
                return None
            arguments = call.get("arguments", {})
            calls.append({"index": self.count, "id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}",
                          "type": "function", "function": {
                              "name": call["name"],
                              "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)}})
            self.count += 1
        return calls
