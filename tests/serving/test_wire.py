"""serving/wire.py: every field of a GenerationRequest survives the gRPC wire and back (the
dataclass's fields are iterated, so a field added later and left off the wire fails here),
and the router's message is that conversion's."""

import dataclasses

import pytest

from distributed.runtime.grammar import json_schema_grammar
from distributed.runtime.request import GenerationRequest
from distributed.serving.proto import generation_pb2 as pb
from distributed.serving.wire import OFF_WIRE, from_wire, to_wire, wire_name
from launch.router.remote_scheduler import check_grammar
from launch.router.replay import generate_request

# A value unlike the default for every field (float32-exact where the wire is float32: logit_bias).
VALUES = {"prompt_ids": [3, 1, 4], "max_tokens": 77, "temperature": 0.7, "top_p": 0.9, "top_k": 5, "min_p": 0.05,
          "seed": 2**63 + 5, "stop": ["\n\n", "END"], "presence_penalty": 0.5, "frequency_penalty": -0.25,
          "repetition_penalty": 1.25, "presence_context_size": 7, "frequency_context_size": 8,
          "repetition_context_size": 9, "logit_bias": {5: 2.5, 7: -100.0}, "top_logprobs": 3,
          "prompt_logprobs": True, "resume_ids": [9, 8], "speculative": False,
          "grammar": json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}})}


def test_every_field_survives_the_round_trip():
    names = [f.name for f in dataclasses.fields(GenerationRequest) if f.name not in OFF_WIRE]
    missing = [n for n in names if n not in VALUES]
    assert not missing, f"give the new field(s) {missing} a value here (and a place on the wire: wire.py)"
    request = GenerationRequest(**VALUES)
    for name in names:
        assert getattr(request, name) != getattr(GenerationRequest(prompt_ids=[1]), name) or name == "prompt_ids", name
    message = pb.GenerateRequest.FromString(to_wire(request).SerializeToString())  # as it travels
    back = GenerationRequest(**from_wire(message))
    for name in names:
        assert getattr(back, name) == getattr(request, name), (name, wire_name(name))


def test_unset_fields_take_the_defaults():
    back = from_wire(pb.GenerateRequest(token_ids=[1, 2]), max_tokens=12)
    request = GenerationRequest(**back)
    assert request.max_tokens == 12 and request.seed is None and request.speculative and request.grammar is None
    assert request.temperature == GenerationRequest(prompt_ids=[1]).temperature


def test_the_router_forwards_through_it():
    request = GenerationRequest(**VALUES)
    message = generate_request(request, [4, 4], False)
    assert message == to_wire(request, resume_ids=[4, 4], prompt_logprobs=False)
    assert message.llguidance == VALUES["grammar"] and message.speculative is False and message.seed == VALUES["seed"]


def test_the_router_refuses_a_grammar_as_rank_0_does():
    check_grammar(VALUES["grammar"])
    with pytest.raises(ValueError, match="grammar: the grammar library rejects it"):
        check_grammar('{"grammars": [{"json_schema": {"type": "wat"}}]}')
