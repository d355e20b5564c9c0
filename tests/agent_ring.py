"""A real 2-rank ring serving HTTP for the agent APIs' tests (serving/test_constraints.py,
test_responses_api.py, test_anthropic_api.py, test_ollama_api.py): the tool-calling tiny
checkpoint (tool_checkpoint.py: its chat template takes tools, its greedy chat answer is
one get_weather call), speculating with prompt lookup as the gRPC tests' 2-rank server."""

import re
import time
from types import SimpleNamespace

from mlx_lm.utils import load_tokenizer

from distributed.shard.config import read_config
from grpc_server import SERVER_ARGS, Server
from tool_checkpoint import make_tool_checkpoint

TOOLS = [  # OpenAI's form; get_weather is the one the weights call
    {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                      "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                     "required": ["city"]}}},
    {"type": "function", "function": {"name": "get_time", "description": "The time in a zone",
                                      "parameters": {"type": "object",
                                                     "properties": {"zone": {"enum": ["UTC", "CET", "PST"]},
                                                                    "hour24": {"type": "boolean"}},
                                                     "required": ["zone", "hour24"], "additionalProperties": False}}},
]


def start_agent_ring(tmp_path_factory, extra=()):
    """(namespace with base_url, port, path, tokenizer, server); stop it with server.stop()."""
    path = make_tool_checkpoint(tmp_path_factory.mktemp("agent_model"))
    server = Server(path, 2, [*SERVER_ARGS, "--http", "127.0.0.1:0", "--prompt-lookup", "--speculate", "always", *extra])
    try:
        server.wait_serving()
        while not (listening := re.search(r"and \S+:(\d+) \(HTTP\)", server.output())):
            time.sleep(0.01)  # health turns SERVING just before rank 0 logs its addresses
    except BaseException:
        server.stop()
        raise
    port = int(listening.group(1))
    tokenizer = load_tokenizer(path, eos_token_ids=read_config(path)["eos_token_id"])
    return SimpleNamespace(base_url=f"http://127.0.0.1:{port}", port=port, path=path, model=str(path),
                           tokenizer=tokenizer, server=server)


def access_lines(ring, route):
    """The access-log lines of `route` the ring's rank 0 has written so far."""
    return [line for line in ring.server.output(tail=10**9).splitlines() if f"route={route} " in line]


def access_line(ring, route, before: int):
    """The access-log line of the next request to `route` after `before` lines (written as its answer ends)."""
    for _ in range(200):
        lines = access_lines(ring, route)
        if len(lines) > before:
            return lines[before]
        time.sleep(0.05)
    raise AssertionError("no access-log line for " + route)
