"""Coding agents, the real clients from npm, against a ring of two.

Codex CLI (`codex exec`, its Responses wire API) and Claude Code (`claude -p`, Anthropic's Messages)
run non-interactively with their default settings but the base URL, a key, and the switches that
keep them off the network (telemetry, updates). Each exits 0 having printed a reply the server
logged as served, and its second request of the same session (`resume --last`, `--continue`) is
served from the prefix cache: everything the first request's prompt held is restored, not computed;
a new session's first request (another question, the same directory) has most of its prompt restored.
The ring serves the embedded default model's tokenizer, chat template (tools, Trinity's call format)
and context (65,536 tokens) as a 2-layer bigram table whose reply to anything is a few words
(tool_checkpoint.make_short_answer_checkpoint): the clients sample at temperature 1, and the real
tiny weights then write thousands of tokens at a 34k-token context, minutes of this CPU that test
nothing of the clients.
The ring sends keep-alives (SSE comments) every TRINITY_KEEPALIVE_S while a streamed reply's first
token is pending: the clients meet them during their long prefills, and a test checks they come.
Their first prompts are long (Codex ~15k tokens through this tokenizer, Claude Code ~34k): the ranks
preload OpenBLAS where it is installed (README's set-up), or this CPU's reference BLAS takes minutes.
The clients come from README's set-up (`npm install --prefix .agents …`), pinned.
"""

import ctypes.util
import json
import os
import re
import shutil
import subprocess
import time

import anthropic
import openai
import pytest

from bench.agents import codex_config
from conftest import ROOT, needs
from grpc_server import Server
from tool_checkpoint import make_short_answer_checkpoint

pytestmark = pytest.mark.slow

AGENTS = ROOT / ".agents" / "node_modules"
CODEX = AGENTS / ".bin" / "codex"
# Claude Code's wrapper finds its native binary itself, whether or not npm ran the package's postinstall.
CLAUDE_WRAPPER = AGENTS / "@anthropic-ai" / "claude-code" / "cli-wrapper.cjs"
OFFLINE = {"DISABLE_TELEMETRY": "1", "DISABLE_AUTOUPDATER": "1", "DISABLE_ERROR_REPORTING": "1",
           "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1", "NO_UPDATE_NOTIFIER": "1"}
TIMEOUT_S = 420
KEEPALIVE_S = "0.05"  # the ring's keep-alive interval (TRINITY_KEEPALIVE_S), shorter than a long prompt's prefill


def installed():
    node = shutil.which("node")
    if node is None or not CODEX.exists() or not CLAUDE_WRAPPER.exists():
        needs("node and the coding agents in .agents/ (scripts/setup-dev.sh installs them with npm)")
    return node


@pytest.fixture(scope="module")
def ring(tmp_path_factory):
    blas = ctypes.util.find_library("openblas")
    environment = {"LD_PRELOAD": blas, "OPENBLAS_NUM_THREADS": "1"} if blas else {}
    environment["TRINITY_KEEPALIVE_S"] = KEEPALIVE_S  # the agents' long prefills meet keep-alives too
    path = make_short_answer_checkpoint(tmp_path_factory.mktemp("agent_model"))
    server = Server(path, 2, ["--http", "127.0.0.1:0"], environment=environment)
    try:
        server.wait_serving()
        server.http = server.http_address()
        server.model = str(path)
        yield server
    finally:
        server.stop()


def served(ring, route: str) -> list:
    """(prompt_tokens, cached_tokens) of each request to `route` the access log shows, with status 200."""
    lines = [line for line in ring.output(tail=10**9).splitlines() if f"route={route} status=200 " in line]
    return [tuple(int(re.search(f"{name}=(\\d+)", line).group(1)) for name in ("prompt_tokens", "cached_tokens"))
            for line in lines]


def run(cmd, cwd, env) -> str:
    proc = subprocess.run(cmd, cwd=cwd, env={**os.environ, **OFFLINE, **env}, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert proc.stdout.strip(), proc.stderr[-2000:]  # it printed a reply
    return proc.stdout


def session(ring, route: str, commands, cwd, env) -> list:
    """Run the commands one after the other; for each, the largest request it made (prompt tokens,
    cached tokens) as the access log shows it (a line is written as its answer ends: waited for)."""
    largest = []
    for cmd in commands:
        before = len(served(ring, route))
        run(cmd, cwd, env)
        end = time.monotonic() + 30
        while len(served(ring, route)) == before and time.monotonic() < end:
            time.sleep(0.05)
        made = served(ring, route)[before:]
        assert made, f"no {route} request served for {cmd}"
        largest.append(max(made))
    return largest


def assert_second_from_cache(requests):
    (first, _), (second, cached) = requests
    assert first > 10_000 and second > first and cached >= first, requests  # the whole first prompt restored


@pytest.fixture(scope="module")
def codex(ring, tmp_path_factory):
    """(command, directory, environment) of Codex pointed at the ring: one home and one directory
    for the module's sessions."""
    installed()
    host, port = ring.http
    root = tmp_path_factory.mktemp("codex")
    home, work = root / "codex-home", root / "work"
    home.mkdir(), work.mkdir()
    (home / "config.toml").write_text(codex_config(ring.model, host, port))
    env = {"CODEX_HOME": str(home), "TRINITY_KEY": "dummy"}
    return [str(CODEX), "exec", "--skip-git-repo-check"], work, env


@pytest.fixture(scope="module")
def claude(ring, tmp_path_factory):
    """(command, directory, environment) of Claude Code pointed at the ring, as `codex`."""
    node = installed()
    host, port = ring.http
    home = tmp_path_factory.mktemp("claude")
    env = {"HOME": str(home), "ANTHROPIC_BASE_URL": f"http://{host}:{port}", "ANTHROPIC_API_KEY": "dummy"}
    return [node, str(CLAUDE_WRAPPER), "-p", "--model", ring.model], home, env


def test_codex_exec(ring, codex):
    cmd, cwd, env = codex
    assert_second_from_cache(session(ring, "/v1/responses", [[*cmd, "say hello"], [*cmd, "resume", "--last", "say more"]],
                                     cwd, env))


def test_claude_code_print(ring, claude):
    cmd, cwd, env = claude
    assert_second_from_cache(session(ring, "/v1/messages", [[*cmd, "say hello"], [*cmd, "--continue", "say more"]],
                                     cwd, env))


QUESTION = "What does this project do? Answer in one line."


@pytest.mark.parametrize("client, route", [("codex", "/v1/responses"), ("claude", "/v1/messages")])
def test_a_new_session_starts_from_the_last_ones_prefix(ring, client, route, request):
    """A second session in the same directory, another question: its first request shares all but
    the user's text with the first session's (docs/agents.md: Codex 15,328 of 15,334 tokens;
    Claude Code 31,021 of 33,584, once its billing header, whose suffix follows the question, is
    dropped), and the prefix cache restores most of it."""
    cmd, cwd, env = request.getfixturevalue(client)
    if not served(ring, route):  # run alone: the first session first
        session(ring, route, [[*cmd, "say hello"]], cwd, env)
    (prompt, cached), = session(ring, route, [[*cmd, QUESTION]], cwd, env)
    assert prompt > 10_000 and cached >= 0.9 * prompt, (prompt, cached)


def long_prompt(tag: str) -> str:
    """About 4,000 tokens (its prefill takes seconds here), beginning with `tag` so the prefix
    cache holds nothing of it."""
    return tag + " " + " ".join(f"item {i}: {i * 7 % 1000}" for i in range(600)) + "\nSay hello."


def test_a_streamed_reply_keeps_alive_while_a_long_prompt_prefills(ring):
    """Before the first token of a long prompt, a streamed reply gets an SSE comment (": keep-alive")
    every TRINITY_KEEPALIVE_S, so a client with an idle timeout waits on; the `openai` and `anthropic`
    packages read such streams as any other (and Codex and Claude Code met them above)."""
    host, port = ring.http
    client = openai.OpenAI(base_url=f"http://{host}:{port}/v1", api_key="none", max_retries=0, timeout=300)
    ask = dict(model=ring.model, temperature=0, max_tokens=8)
    with client.chat.completions.with_streaming_response.create(
            messages=[{"role": "user", "content": long_prompt("raw")}], stream=True, **ask) as response:
        lines = list(response.iter_lines())
    first_text = next(i for i, line in enumerate(lines) if line.startswith("data: {")
                      and json.loads(line[6:])["choices"][0]["delta"].get("content"))
    assert ": keep-alive" in lines[:first_text], lines[:8]
    messages = [{"role": "user", "content": long_prompt("openai")}]
    streamed = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(
        messages=messages, stream=True, **ask) if c.choices)
    assert streamed == client.chat.completions.create(messages=messages, **ask).choices[0].message.content
    claude = anthropic.Anthropic(base_url=f"http://{host}:{port}", api_key="none", max_retries=0, timeout=300)
    messages = [{"role": "user", "content": long_prompt("anthropic")}]
    greedy = dict(model=ring.model, max_tokens=8, messages=messages, extra_body={"temperature": 0})
    with claude.messages.stream(**greedy) as stream:  # (the SDK has no temperature argument now)
        streamed = "".join(stream.text_stream)
    whole = claude.messages.create(**greedy)
    assert streamed == "".join(block.text for block in whole.content if block.type == "text")
