"""A GenerationRequest (runtime/request.py) on the gRPC wire and back: the one conversion the
gRPC service, the command-line client and the launcher's router share, so that a request
means the same on every path.

Every field of GenerationRequest goes on the wire (tests/serving/test_wire.py iterates the
dataclass's fields, so a field added later and left out here fails it), save those in
OFF_WIRE: `deadline`, which gRPC carries as the call's own timeout. `prompt_ids` travel as
`token_ids`, `resume_ids` as `resume_token_ids`, and `grammar` (an llguidance grammar as the
library serializes it, whatever field it came from) as the `llguidance` constraint.
"""

import dataclasses
import json
from typing import Optional

from ..runtime.grammar import json_schema_grammar, lark_grammar, regex_grammar
from ..runtime.request import GenerationRequest, RequestError
from .proto import generation_pb2 as pb

OFF_WIRE = ("deadline",)  # the call's timeout
RENAMED = {"prompt_ids": "token_ids", "resume_ids": "resume_token_ids", "grammar": "llguidance"}
# Proto3 optional fields: unset means "the server's default" (GenerationRequest's, here).
OPTIONAL = {f.name for f in pb.GenerateRequest.DESCRIPTOR.fields if f.has_presence and f.containing_oneof is None
            or (f.containing_oneof is not None and f.containing_oneof.name.startswith("_"))}


def wire_name(name: str) -> str:
    return RENAMED.get(name, name)


def to_wire(r: GenerationRequest, **overrides) -> pb.GenerateRequest:
    """`r` as a GenerateRequest (token ids, every sampling field, its grammar); `overrides`
    replace fields by their request name (e.g. resume_ids, prompt_logprobs on a replay)."""
    out = pb.GenerateRequest()
    for field in dataclasses.fields(GenerationRequest):
        if field.name in OFF_WIRE:
            continue
        value = overrides.get(field.name, getattr(r, field.name))
        set_field(out, field.name, value)
    return out


def set_field(message: pb.GenerateRequest, name: str, value) -> None:
    """One GenerationRequest field (by its name) into `message`; None leaves it unset."""
    if value is None:
        return
    target = wire_name(name)
    if target == "logit_bias":
        message.logit_bias.clear()
        message.logit_bias.update({int(k): float(v) for k, v in value.items()})
    elif isinstance(value, (list, tuple)):
        getattr(message, target)[:] = list(value)
    else:
        setattr(message, target, value)


def wire_grammar(r: pb.GenerateRequest) -> Optional[str]:
    """The llguidance grammar of the request's constraint field, if one is set."""
    which = r.WhichOneof("constraint")
    if which == "json_schema":
        try:
            schema = json.loads(r.json_schema)
        except ValueError as e:
            raise RequestError("json_schema", f"not JSON: {e}") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError("json_schema", "expected a JSON schema object")
        return json_schema_grammar(schema)
    if which == "lark_grammar":
        return lark_grammar(r.lark_grammar)
    if which == "regex":
        return regex_grammar(r.regex)
    return r.llguidance if which == "llguidance" else None


def from_wire(r: pb.GenerateRequest, prompt_ids=None, **defaults) -> dict:
    """GenerationRequest's keyword arguments from `r`: a field left unset takes `defaults`' value
    (by request name), else GenerationRequest's own default. `prompt_ids` replace the wire's token
    ids (a prompt or messages the server tokenized)."""
    out = {}
    for field in dataclasses.fields(GenerationRequest):
        name = field.name
        if name in OFF_WIRE:
            continue
        target = wire_name(name)
        if name == "grammar":
            out[name] = wire_grammar(r)
        elif name == "prompt_ids":
            out[name] = list(r.token_ids) if prompt_ids is None else list(prompt_ids)
        elif name == "logit_bias":
            out[name] = dict(r.logit_bias)
        elif target in OPTIONAL:
            if r.HasField(target):
                out[name] = getattr(r, target)
            elif name in defaults:
                out[name] = defaults[name]
        else:
            value = getattr(r, target)
            out[name] = list(value) if not isinstance(value, (str, bytes, int, float, bool)) else value
    return out
