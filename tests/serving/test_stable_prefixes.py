"""Stable prefixes for agents (issue 56): what changes per request and no model should see is
dropped before templating (Claude Code's `x-anthropic-billing-header` system block, or line of a
string system), named in the access log; system entries after the first turn stay where they
stand, so that a session's turn 2 renders a prompt extending turn 1's prompt and reply, and two
sessions' first requests share everything before the user's text. Requests are shaped as the
real clients send them (Claude Code 2.1.197's `claude -p`, Codex 0.171.0's `codex exec`, as
captured against the test ring; trimmed), rendered with the embedded model's tokenizer and chat
template, and with ChatML templates that refuse a later system message, hoist it, or take no two
user turns in a row; and served through the HTTP API by an in-process server of the embedded
model with its prefix cache on."""

import json
import logging
import shutil
import time
from types import SimpleNamespace

import anthropic
import openai
import pytest
from mlx_lm.utils import load_tokenizer

from distributed.runtime.scheduler import Scheduler
from distributed.serving import anthropic_api, responses_api
from distributed.serving.chat_format import ModelInfo, later_system_mode, place_system
from distributed.serving.http_api import start_http_server
from distributed.serving.openai_api import chat_prompt
from distributed.serving.options import ServeOptions
from distributed.serving.sealed import Sealer
from distributed.shard.config import read_config
from distributed.shard.tiny_checkpoint import DEFAULT_MODEL
from stages import in_process_pipeline

BILLED = "system.x-anthropic-billing-header"
INFO = ModelInfo("trinity-tiny", 2048, 65536, 65536)
REMINDER = ("<system-reminder>\nAs you answer the user's questions, you can use the following context:\n"
            "# currentDate\nToday's date is 2026-12-07.\n</system-reminder>\n\n")
AGENTS = "Available agent types for the Agent tool:\n- claude: Catch-all for any task. (Tools: *)\n"
SYSTEM = ["You are a Claude agent, built on Anthropic's Claude Agent SDK.",
          "\nYou are an interactive agent that helps users with software engineering tasks.\n\n# Environment\n"
          " - Primary working directory: /tmp/work\n - Is a git repository: false\n - Platform: linux\n"]
CLAUDE_TOOLS = [{"name": "Bash", "description": "Executes a given bash command.",
                 "input_schema": {"type": "object", "properties": {"command": {"type": "string"}},
                                  "required": ["command"], "additionalProperties": False}},
                {"name": "Read", "description": "Reads a file.",
                 "input_schema": {"type": "object", "properties": {"file_path": {"type": "string"}},
                                  "required": ["file_path"]}}]
CODEX_TOOLS = [{"type": "function", "name": "exec_command", "description": "Runs a command in a PTY.", "strict": False,
                "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}},
               {"type": "web_search", "external_web_access": False}]
ENVIRONMENT = ("<environment_context>\n  <cwd>/tmp/work</cwd>\n  <shell>bash</shell>\n"
               "  <current_date>2026-12-07</current_date>\n  <timezone>Etc/UTC</timezone>\n</environment_context>")

# ChatML templates as many checkpoints have them (tools in the system turn): one that refuses a
# system message after the first (raise_exception), one that moves every system message to the top,
# and one that also takes no two turns of one role in a row.
HEADER = ("{%- set system = messages | selectattr('role', 'equalto', 'system') | list -%}"
          "{%- if tools or messages[0].role == 'system' %}<|im_start|>system\n"
          "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n{% endif %}"
          "{% if tools %}# Tools\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}{% endif %}<|im_end|>\n"
          "{% endif %}")
TURN = ("<|im_start|>{{ message.role }}\n{{ message.content or '' }}"
        "{% for call in message.tool_calls or [] %}{% set tool_call = call.function %}<tool_call>\n"
        "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>{% endfor %}"
        "<|im_end|>\n")
CLOSE = "{%- endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
FIRST_ONLY = (HEADER + "{%- for message in messages %}{%- if message.role == 'system' %}"
              "{% if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
              "{%- else %}" + TURN + "{% endif %}" + CLOSE)
HOISTING = (HEADER.replace("{{ messages[0].content }}\n", "{% for m in system %}{{ m.content }}\n{% endfor %}")
            + "{%- for message in messages if message.role != 'system' %}" + TURN + CLOSE)
ALTERNATING = (HEADER + "{%- for message in messages %}{%- if message.role == 'system' %}"
               "{% if not loop.first %}{{ raise_exception('System message must be at the beginning.') }}{% endif %}"
               "{%- else %}{% if not loop.first and message.role == messages[loop.index0 - 1].role %}"
               "{{ raise_exception('Conversation roles must alternate') }}{% endif %}" + TURN + "{% endif %}" + CLOSE)
TEMPLATES = {"embedded": None, "first_only": FIRST_ONLY, "hoisting": HOISTING, "alternating": ALTERNATING}


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    """The embedded model's tokenizer with its own chat template, and with each of TEMPLATES'."""
    out = {}
    for name, template in TEMPLATES.items():
        if template is None:
            out[name] = load_tokenizer(DEFAULT_MODEL)
            continue
        path = tmp_path_factory.mktemp(name)
        for file in DEFAULT_MODEL.iterdir():
            if not file.name.endswith(".safetensors"):
                shutil.copy(file, path / file.name)
        config = json.loads((path / "tokenizer_config.json").read_text())
        (path / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": template}))
        out[name] = load_tokenizer(path)
    return out


def claude_request(text: str, suffix: str = "1c0", history=(), session: str = "ef665b28") -> dict:
    """Claude Code 2.1.197's `claude -p TEXT` request (trimmed): its billing block first in
    `system` (the suffix derives from the first user text), the date reminder and the user's text
    in the first turn, a mid-conversation system entry after it, then the turns of `history`."""
    return {"model": "trinity-tiny", "max_tokens": 32000, "stream": True,
            "system": [{"type": "text", "text": f"x-anthropic-billing-header: cc_version=2.1.197.{suffix}; "
                                                "cc_entrypoint=sdk-cli;"},
                       {"type": "text", "text": SYSTEM[0], "cache_control": {"type": "ephemeral"}},
                       {"type": "text", "text": SYSTEM[1], "cache_control": {"type": "ephemeral"}}],
            "messages": [{"role": "user", "content": [{"type": "text", "text": REMINDER},
                                                      {"type": "text", "text": text,
                                                       **({} if history else {"cache_control": {"type": "ephemeral"}})}]},
                         {"role": "system", "content": AGENTS}, *history],
            "tools": CLAUDE_TOOLS, "thinking": {"type": "adaptive"},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "output_config": {"effort": "high"},
            "metadata": {"user_id": json.dumps({"device_id": "c24f", "account_uuid": "", "session_id": session})}}


def codex_request(text: str, history=(), session: str = "01a24f02") -> dict:
    """Codex 0.171.0's `codex exec TEXT` request (trimmed): two developer messages, the
    environment context, the user's text, then the items of `history`; ids in every item."""
    return {"model": "trinity-tiny", "stream": True, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": session, "client_metadata": {"session_id": session, "turn_id": session + "-1"},
            "tools": CODEX_TOOLS,
            "input": [{"type": "message", "id": f"msg_{session}a", "role": "developer",
                       "content": [{"type": "input_text", "text": "You are a coding agent running in the Codex CLI."}]},
                      {"type": "message", "id": f"msg_{session}b", "role": "developer",
                       "content": [{"type": "input_text", "text": "<skills_instructions>\n## Skills\n</skills_instructions>"}]},
                      {"type": "message", "id": f"msg_{session}c", "role": "user",
                       "content": [{"type": "input_text", "text": ENVIRONMENT}]},
                      {"type": "message", "id": f"msg_{session}d", "role": "user",
                       "content": [{"type": "input_text", "text": text}]}, *history]}


def render(body: dict, tokenizer) -> tuple:
    """(prompt ids, the chat body) of a Messages or Responses request, as the server renders it."""
    if "input" in body:
        _, chat = responses_api.parse_request(body, INFO, tokenizer, Sealer())
    else:
        _, chat = anthropic_api.parse_request(body, INFO, tokenizer)
    return chat_prompt(chat, tokenizer)[0], chat


def shared(a: list, b: list) -> int:
    return next((k for k, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def test_the_billing_block_is_dropped_and_named(tokenizers):
    tokenizer = tokenizers["embedded"]
    body = claude_request("say hello")
    unbilled = {**body, "system": body["system"][1:]}
    _, chat = render(body, tokenizer)
    _, reference = render(unbilled, tokenizer)
    assert chat.messages == reference.messages and chat.messages[0] == {"role": "system",
                                                                                "content": "".join(SYSTEM)}
    assert chat.ignored.count(BILLED) == 1 and BILLED not in reference.ignored
    assert [n for n in chat.ignored if n != BILLED] == reference.ignored  # the other names as before
    counted = [anthropic_api.count_tokens({k: v for k, v in b.items() if k in anthropic_api.PROMPT}, None, tokenizer, INFO)
               for b in (body, unbilled)]
    assert counted[0] == counted[1] == (200, {"input_tokens": len(render(unbilled, tokenizer)[0])})
    alone = {**body, "system": body["system"][:1]}  # nothing but the header: no system prompt at all
    assert render(alone, tokenizer)[1].messages[0]["role"] == "user"


@pytest.mark.parametrize("system, kept", [
    ("x-anthropic-billing-header: cc_version=2.1.197.1c0; cc_entrypoint=sdk-cli; cch=9f3a1;\nYou are Claude Code.",
     "You are Claude Code."),
    ("You are Claude Code.\nx-anthropic-billing-header: cc_version=2.1.197.b75;\r\nBe brief.\n",
     "You are Claude Code.\nBe brief.\n"),
    ("x-anthropic-billing-header: cc_version=2.1.197.1c0;", None),
])
def test_the_billing_line_of_a_string_system_is_dropped(tokenizers, system, kept):
    ignored = []
    chat = anthropic_api._prompt(anthropic_api.MessagesRequest.model_validate({"model": "m", "system": system, "messages": [{"role": "user", "content": "hi"}]}),
                                 tokenizers["embedded"], ignored=ignored)
    assert chat["messages"] == ([{"role": "system", "content": kept}] if kept else []) + [{"role": "user", "content": "hi"}]
    assert ignored == [BILLED]


def test_the_billing_line_is_dropped_only_where_it_begins_a_system_line(tokenizers):
    """Text that mentions it (a line not beginning with it, a user's turn) is the client's own."""
    ignored = []
    said = "Claude Code sends x-anthropic-billing-header: in its system prompt."
    chat = anthropic_api._prompt(anthropic_api.MessagesRequest.model_validate({"model": "m", "system": [{"type": "text", "text": said}, {"type": "text", "text": " x"}],
                                  "messages": [{"role": "user", "content": "x-anthropic-billing-header: hi"},
                                               {"role": "assistant", "content": "ok"},
                                               {"role": "system", "content": "x-anthropic-billing-header: a;\nnote"},
                                               {"role": "user", "content": "more"}]}),
                                 tokenizers["embedded"], ignored=ignored)
    assert chat["messages"] == [{"role": "system", "content": said + " x"},
                                {"role": "user", "content": "x-anthropic-billing-header: hi"},
                                {"role": "assistant", "content": "ok"}, {"role": "system", "content": "note"},
                                {"role": "user", "content": "more"}]
    assert ignored == ["messages.system.x-anthropic-billing-header"]


def test_later_system_modes_of_the_templates(tokenizers):
    assert {name: later_system_mode(t) for name, t in tokenizers.items()} == {
        "embedded": "system", "first_only": "user", "hoisting": "user", "alternating": "merge"}


def test_later_system_entries_stay_where_they_stand():
    """A template that raises on a system message after the first turn (as many do) gets Claude
    Code's later system entries as user turns where they stand, never joined to the system prompt
    (which would rewrite the prompt's beginning at every turn that adds one); system messages before
    the first turn are joined into one."""
    from jinja2 import TemplateError

    class FirstOnly:
        def apply_chat_template(self, messages, **kwargs):
            if any(m["role"] == "system" for m in messages[1:]):
                raise TemplateError("System message must be at the beginning.")
            return "".join(m["content"] for m in messages)

    messages = [{"role": "system", "content": "You are Claude Code."}, {"role": "developer", "content": "Be brief."},
                {"role": "user", "content": "a"}, {"role": "system", "content": "<reminder>"},
                {"role": "user", "content": "b"}]
    assert place_system(messages, FirstOnly()) == [
        {"role": "system", "content": "You are Claude Code.\n\nBe brief."}, {"role": "user", "content": "a"},
        {"role": "user", "content": "<reminder>"}, {"role": "user", "content": "b"}]
    assert place_system(messages[2:], FirstOnly())[1] == {"role": "user", "content": "<reminder>"}
    assert place_system(messages[2:3], FirstOnly()) == messages[2:3]


def test_merged_where_the_template_takes_no_two_user_turns(tokenizers):
    tokenizer = tokenizers["alternating"]
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
                {"role": "system", "content": "r1"}, {"role": "assistant", "content": "b"},
                {"role": "system", "content": "r2"}, {"role": "user", "content": "c"},
                {"role": "assistant", "content": "d"}, {"role": "system", "content": "r3"},
                {"role": "assistant", "content": "e"}]
    assert place_system(messages, tokenizer) == [
        {"role": "system", "content": "S"}, {"role": "user", "content": "a\n\nr1"}, {"role": "assistant", "content": "b"},
        {"role": "user", "content": "r2\n\nc"}, {"role": "assistant", "content": "d"}, {"role": "user", "content": "r3"},
        {"role": "assistant", "content": "e"}]


@pytest.mark.parametrize("template", TEMPLATES)
def test_two_claude_code_sessions_share_all_before_the_users_text(tokenizers, template):
    """Two first requests that differ only in the billing header's suffix, the session id and the
    user's text share every token before the user's text."""
    tokenizer = tokenizers[template]
    one, _ = render(claude_request("say hello", "1c0", session="a"), tokenizer)
    two, _ = render(claude_request("What does this project do? Answer in one line.", "b75", session="b"), tokenizer)
    k = shared(one, two)
    before = tokenizer.decode(one)
    before = before[:before.index("say hello")]
    assert len(tokenizer.decode(one[:k])) >= len(before) - 2 and before.startswith(tokenizer.decode(one[:k])), (
        template, tokenizer.decode(one[k - 20:k + 5]))
    assert "x-anthropic-billing-header" not in before and "cc_version" not in before


def claude_turns(tokenizer, reply="Hi there!"):
    one = claude_request("say hello")
    two = claude_request("say hello", history=[{"role": "assistant", "content": [{"type": "text", "text": reply}]},
                                               {"role": "user", "content": [{"type": "text", "text": "say more"}]},
                                               {"role": "system", "content": "<system-reminder>new</system-reminder>"}])
    return render(one, tokenizer)[0], render(two, tokenizer)[0]


def codex_turns(tokenizer, reply="Hi there!"):
    one = codex_request("say hello")
    two = codex_request("say hello", history=[
        {"type": "message", "status": "completed", "id": "msg_9c59", "role": "assistant",
         "content": [{"type": "output_text", "text": reply, "annotations": []}]},
        {"type": "message", "id": "msg_01a2", "role": "user", "content": [{"type": "input_text", "text": "say more"}]},
        {"type": "message", "id": "msg_01a3", "role": "developer",
         "content": [{"type": "input_text", "text": "<permissions instructions>ask</permissions instructions>"}]}])
    return render(one, tokenizer)[0], render(two, tokenizer)[0]


@pytest.mark.parametrize("template", TEMPLATES)
@pytest.mark.parametrize("turns", [claude_turns, codex_turns])
def test_turn_two_extends_turn_one_and_its_reply(tokenizers, template, turns):
    if template == "alternating" and turns is codex_turns:
        pytest.skip("Codex sends two user turns in a row (its environment, then the text): such a template refuses them")
    tokenizer = tokenizers[template]
    one, two = turns(tokenizer)
    assert two[:len(one)] == one, (template, tokenizer.decode(one[-10:]), tokenizer.decode(two[len(one) - 10:len(one) + 5]))
    assert tokenizer.decode(two[len(one):]).lstrip("\n").startswith("Hi there!")


# Through the HTTP API: an in-process server of the embedded model, its prefix cache on.

@pytest.fixture(scope="module")
def served():
    pipeline, _ = in_process_pipeline(DEFAULT_MODEL, (3, 3))
    tokenizer = load_tokenizer(DEFAULT_MODEL, eos_token_ids=read_config(DEFAULT_MODEL)["eos_token_id"])
    scheduler = Scheduler(pipeline, tokenizer, prefix_cache_bytes=1 << 28).start()
    front = start_http_server(ServeOptions(grpc_address="127.0.0.1:0", http_address="127.0.0.1:0"))
    try:
        front.attach(scheduler, tokenizer, ModelInfo("trinity-tiny", read_config(DEFAULT_MODEL)["vocab_size"],
                                                     65536, 65536))
        yield SimpleNamespace(scheduler=scheduler, url=f"http://127.0.0.1:{front.port}", tokenizer=tokenizer)
    finally:
        front.stop()
        scheduler.close()


def access_line(caplog, route: str) -> str:
    """The access log's line for `route`: the server writes it just after the client has read the
    reply's last event, so it may come a moment after the client returns."""
    deadline = time.monotonic() + 30
    while True:
        lines = [r.getMessage() for r in list(caplog.records)
                 if r.name == "trinity.access" and f"route={route} " in r.getMessage()]
        if lines:
            return lines[-1]
        assert time.monotonic() < deadline, f"no access-log line for {route}"
        time.sleep(0.01)


def test_claude_code_turns_through_the_http_api(served, submitted, caplog):
    """Turn 2 (with turn 1's reply as it came back) renders a prompt that extends turn 1's, and the
    prefix cache restores it; the billing block is named in the access log."""
    client = anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0, timeout=120)

    def send(body):
        fields = {k: body[k] for k in ("model", "max_tokens", "system", "messages", "tools", "metadata")}
        extra = {k: body[k] for k in ("thinking", "output_config", "context_management")}
        with client.messages.stream(**fields, extra_body={**extra, "temperature": 0}) as stream:
            return stream.get_final_message()

    with caplog.at_level(logging.INFO, logger="trinity.access"):
        first = send({**claude_request("say hello"), "max_tokens": 8})
        assert BILLED in access_line(caplog, "/v1/messages").split("ignored=")[1]
        reply = [block.model_dump(exclude_none=True) for block in first.content]
        second = send({**claude_request("say hello", history=[{"role": "assistant", "content": reply},
                                                              {"role": "user", "content": "say more"}]),
                       "max_tokens": 8})
    one, two = (handle.request.prompt_ids for handle in submitted)
    assert two[:len(one)] == one
    assert second.usage.cache_read_input_tokens >= len(one) - 256, (second.usage, len(one))


def test_codex_turns_through_the_http_api(served, submitted):
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="none", max_retries=0, timeout=120)

    def send(body):
        response = client.responses.create(**{k: v for k, v in body.items() if k not in ("client_metadata", "stream")},
                                           max_output_tokens=8, temperature=0,
                                           extra_body={"client_metadata": body["client_metadata"]})
        return response

    first = send(codex_request("say hello"))
    output = [item.model_dump(exclude_none=True) for item in first.output]
    second = send(codex_request("say hello", history=[*output, {"type": "message", "role": "user",
                                                                "content": [{"type": "input_text", "text": "say more"}]}]))
    one, two = (handle.request.prompt_ids for handle in submitted)
    assert two[:len(one)] == one
    assert second.usage.input_tokens_details.cached_tokens >= len(one) - 256, (second.usage, len(one))
