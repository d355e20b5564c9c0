"""What every network front end (gRPC, OpenAI HTTP) shares: turning a client's
prompt, token ids or chat messages plus sampling fields into a validated
GenerationRequest, and the model facts they report."""

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

from jinja2 import TemplateError

from ..runtime.request import GenerationRequest, RequestError

ROLES = ("system", "developer", "user", "assistant", "tool")  # chat roles a request may use


@dataclass
class ModelInfo:
    model_id: str
    vocab_size: int
    max_context: int
    max_tokens_cap: int
    ranks: List[dict] = field(default_factory=list)  # as in run_trinity.py --json
    max_batch: int = 0  # sequences decoding together


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


def build_request(info: ModelInfo, ids: List[int], **sampling) -> GenerationRequest:
    """A validated request; raises RequestError naming the bad field."""
    request = GenerationRequest(prompt_ids=ids, **sampling)
    request.validate(info.vocab_size, info.max_context, info.max_tokens_cap)
    return request
