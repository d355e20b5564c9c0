"""What every HTTP API here shares at its door: its errors (ApiError), its field policy (one
FieldPolicy table per API, applied by check_fields), a body parsed into the API's typed model
(parse: pydantic, an error naming the field), and the frames of a stream (sse, ndjson).

The compatibility rule (docs/serving.md, "OpenAI fields"): what a real client sends by default
works. A field whose value changes nothing for this server and model is accepted and named in the
access log (`ignored=…`, and the metric trinity_ignored_fields); a limit is clamped; only a field
whose loss would change the reply's meaning and that cannot be honoured is refused by name. A
FieldPolicy says which is which for one API's top-level fields; any other name is unknown (400).

Plain pydantic, not FastAPI: the transport (http_server.py, http_api.py) answers before a body is
read (411, 413, 415, closing the connection), streams byte for byte, and gives each API its own
error shape with a 400 naming the field, where FastAPI answers bad input 422 in its own shape; its
routing and dependency layers would also add modules to every request's path.
"""

import json
import typing
from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from pydantic import BaseModel, ConfigDict, ValidationError

from ..runtime.request import RequestError


class ApiError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.kind, self.param, self.code = status, kind, param, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.kind, "param": self.param, "code": self.code}}


@dataclass(frozen=True)
class FieldPolicy:
    """One API's top-level fields: honoured (`accepted`), accepted with no effect and named in the
    access log (`hints`: name -> the JSON types it takes), accepted only with values that change
    nothing (`neutral`: name -> (values, why)), refused by name (`refused`: name -> why). A value in
    `absent` is as if the field were not sent (null: the API's default)."""

    accepted: Tuple[str, ...]
    hints: Dict[str, tuple] = field(default_factory=dict)
    neutral: Dict[str, tuple] = field(default_factory=dict)
    refused: Dict[str, str] = field(default_factory=dict)
    absent: tuple = (None,)


def check_fields(body: dict, policy: FieldPolicy) -> List[str]:
    """Unknown and refused fields, and neutral ones with another value, are RequestErrors naming
    them; returns the hints the body carries (accepted, ignored: the access log names them)."""
    ignored = []
    for name, value in body.items():
        known = name in policy.accepted or name in policy.hints or name in policy.neutral or name in policy.refused
        if not known:
            raise RequestError(name, "unknown field")
        if any(value is a or (type(value) is type(a) and value == a) for a in policy.absent):
            continue
        if name in policy.refused:
            raise RequestError(name, policy.refused[name])
        if name in policy.neutral and not _same(value, policy.neutral[name][0]):
            raise RequestError(name, f"{json.dumps(value)[:60]} is not supported: {policy.neutral[name][1]}")
        if name in policy.hints:
            kinds = policy.hints[name]
            if kinds and not isinstance(value, kinds):
                raise RequestError(name, f"expected {_names(kinds)}, got {json.dumps(value)[:40]}")
            ignored.append(name)
    return ignored


def _same(value, allowed) -> bool:
    return any(type(value) is type(a) and value == a for a in allowed)


class Typed(BaseModel):
    """A body's typed model: JSON types as they are (strict: a bool is no number, a string no
    int); fields the policy accepted with no effect are not kept."""

    model_config = ConfigDict(strict=True, extra="ignore")


def parse(model: type, body: dict, **extra):
    """`body` as `model` (a Typed), with `extra` fields set by the server; a value of the wrong
    JSON type is a RequestError naming its field: "expected int or number, got \"x\"". Null is
    the field's default."""
    given = {k: v for k, v in body.items() if v is not None and k in model.model_fields}
    try:
        return model.model_validate({**given, **extra})
    except ValidationError as e:
        name = str(e.errors()[0]["loc"][0])
        annotation = model.model_fields[name].annotation
        raise RequestError(name, f"expected {_names(_kinds(annotation))}, got {json.dumps(given[name])[:40]}") from None


def _kinds(annotation) -> tuple:
    """The JSON types an annotation takes: Optional[Union[int, float]] -> (int, float)."""
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Union:
        return tuple(k for a in args for k in _kinds(a) if k is not type(None))
    origin = typing.get_origin(annotation)
    return (origin or annotation,)


def _names(kinds: tuple) -> str:
    return " or ".join("number" if k is float else k.__name__ for k in kinds)


def sse(event: str, data: dict) -> bytes:
    """One server-sent event with a name (as the Responses and Messages APIs send them)."""
    return f"event: {event}\ndata: {json.dumps(data)}\n\n".encode()


def ndjson(obj: dict) -> bytes:
    return json.dumps(obj).encode() + b"\n"
