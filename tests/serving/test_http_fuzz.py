"""Every route of GET /openapi.json driven by schemathesis (hypothesis) against one real
2-rank ring (tests/agent_ring.py), valid and invalid bodies alike, bounded so the module
takes well under a minute here. The invariants: no 5xx but the documented 503
and 507 (and 501 on the routes that are not supported), no Python exception text in any
reply, and after each route's batch the ring still serves a greedy request exactly as before."""

import copy
import json
import os
import re
import urllib.request

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis import GenerationMode

from agent_ring import start_agent_ring

EXAMPLES = int(os.environ.get("TRINITY_FUZZ_EXAMPLES", 10))  # per route, valid and invalid requests together
SMALL = 4  # generation lengths the fuzzer may ask for
PYTHON_ERROR = re.compile(r"Traceback|File \"|\b[A-Z]\w*(Error|Exception)\b: ")
GREEDY = {"prompt": "The", "max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    ring = start_agent_ring(tmp_path_factory)
    yield ring
    ring.server.stop()


def post(ring, path: str, body: dict) -> dict:
    request = urllib.request.Request(ring.base_url + path, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as r:
        return json.loads(r.read())


def bounded(doc: dict, model: str) -> dict:
    """The document with generation held short (every length field required and at most SMALL,
    n at most 2), so that a fuzzed request costs milliseconds here, and `model` the served one
    (valid requests get past the 404 for another)."""
    doc = copy.deepcopy(doc)
    lengths = {"max_tokens", "max_completion_tokens", "max_output_tokens"}
    for path, methods in doc["paths"].items():
        body = methods.get("post", {}).get("requestBody", {}).get("content", {}).get("application/json", {})
        schema = body.get("schema", {})
        properties = schema.get("properties", {})
        if "model" in properties:
            properties["model"] = {"const": model}
        for name in lengths & set(properties):
            properties[name] = {"type": "integer", "minimum": 1, "maximum": SMALL}
        if "n" in properties:
            properties["n"] = {"type": "integer", "minimum": 1, "maximum": 2}
        if path == "/v1/chat/completions":
            properties.pop("max_completion_tokens")
            schema["required"] = [*schema.get("required", []), "max_tokens"]
        elif path in ("/v1/completions", "/v1/responses"):
            schema["required"] = [*schema.get("required", []), *(lengths & set(properties))]
        if path in ("/api/chat", "/api/generate"):
            properties["options"] = {"type": "object", "required": ["num_predict"], "additionalProperties": False,
                                     "properties": {"num_predict": {"type": "integer", "minimum": 1, "maximum": SMALL},
                                                    "temperature": {"type": "number", "minimum": 0, "maximum": 2}}}
            schema["required"] = [*schema.get("required", []), "options"]
    return doc


def operations(doc):
    schema = schemathesis.openapi.from_dict(doc)
    return [result.ok() for result in schema.get_all_operations()]


def test_openapi_routes_survive_fuzzing(ring):
    with urllib.request.urlopen(ring.base_url + "/openapi.json", timeout=30) as r:
        doc = json.loads(r.read())
    expected = post(ring, "/v1/completions", GREEDY)["choices"][0]["text"]
    seen, failures = {}, []
    for operation in operations(bounded(doc, ring.model)):
        strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE), operation.as_strategy(GenerationMode.NEGATIVE))

        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  phases=[Phase.generate], suppress_health_check=list(HealthCheck))
        @given(case=strategy)
        def drive(case):
            response = case.call(base_url=ring.base_url, timeout=60)
            seen[response.status_code] = seen.get(response.status_code, 0) + 1
            text = response.text
            allowed = (503, 507) + ((501,) if operation.path.startswith("/api/") and response.status_code == 501 else ())
            if response.status_code >= 500 and response.status_code not in allowed:
                failures.append(f"{case.method} {case.path}: {response.status_code} {text[:300]} for {case.body!r:.300}")
            elif response.status_code >= 400 and PYTHON_ERROR.search(text):
                failures.append(f"{case.method} {case.path}: Python error text {text[:300]} for {case.body!r:.300}")

        drive()
        again = post(ring, "/v1/completions", GREEDY)["choices"][0]["text"]
        assert again == expected, f"after fuzzing {operation.method.upper()} {operation.path}: {again!r} != {expected!r}"
    log = ring.server.output(tail=10**8)
    assert not failures, "\n".join(failures[:20]) + "\n\nthe server's tracebacks:\n" + "\n".join(
        log[log.find("Traceback", i) - 200:log.find("Traceback", i) + 3000] for i in (0,) if "Traceback" in log)
    assert seen.get(200, 0) > 20 and seen.get(400, 0) > 20, seen  # both valid and invalid requests reached the routes
