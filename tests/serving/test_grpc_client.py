"""python -m distributed.client's JSON (the command line itself runs against real
servers in test_grpc_service.py)."""

import json

from distributed.serving.grpc_client import message_json
from distributed.serving.proto import generation_pb2 as pb


def test_64_bit_fields_are_json_numbers_at_every_depth():
    info = pb.ModelInfo(model_id="m", vocab_size=5, max_context=2**40, max_tokens_cap=7,
                        ranks=[pb.RankInfo(rank=0, peak_memory_bytes=2**63 + 5, parameter_bytes=9), pb.RankInfo(rank=1)])
    out = json.loads(json.dumps(message_json(info)))
    assert out["max_context"] == 2**40 and out["vocab_size"] == 5 and out["model_id"] == "m"
    assert [r["peak_memory_bytes"] for r in out["ranks"]] == [2**63 + 5, 0]  # exact, and unset fields present
    assert [r["parameter_bytes"] for r in out["ranks"]] == [9, 0]
    assert out["ranks"][1] == {"rank": 1, "host": "", "layer_start": 0, "layer_end": 0, "embed": False,
                               "head": False, "peak_memory_bytes": 0, "parameter_bytes": 0,
                               "memory_bytes": 0, "memory_limited": False, "active_memory_bytes": 0,
                               "cache_memory_bytes": 0}


def test_an_optional_64_bit_field_only_when_set():
    assert "seed" not in message_json(pb.GenerateRequest(prompt="x"))
    assert message_json(pb.GenerateRequest(prompt="x", seed=2**64 - 1))["seed"] == 2**64 - 1
