"""The embedded default model (run_trinity.py without --model): trained, shipped as package
data, writes English, and the same text on one device, in 2 stages, on a 2-rank ring and in
one-device mlx-lm. (The random checkpoints tiny_checkpoint makes are every other test's.)"""

import json
import re

import mlx.core as mx
import pytest
from mlx_lm.generate import generate_step
from mlx_lm.utils import load_tokenizer

from conftest import run_json
from distributed.shard.tiny_checkpoint import default_checkpoint
from reference import mlx_lm_model

ARGS = ["--prompt", "The", "--max-tokens", "48"]
WORD = re.compile(r"[A-Za-z]+")


def english_words() -> set:
    """Every word of the pydoc topics (the language reference that ships with Python)."""
    from pydoc_data.topics import topics

    return {w.lower() for text in topics.values() for w in WORD.findall(text)}


def mlx_lm_greedy_ids(prompt, max_tokens, eos):
    model = mlx_lm_model(default_checkpoint())
    ids = []
    for token, _ in generate_step(mx.array(prompt), model, max_tokens=max_tokens):
        if token == eos:
            break
        ids.append(token)
    return ids


def test_default_model_writes_english_the_same_on_every_split():
    one = run_json(ARGS)
    words = WORD.findall(one["text"])
    known = english_words()
    assert len(words) >= 10, one["text"]
    assert sum(w.lower() in known for w in words) >= 0.8 * len(words), one["text"]

    # The prompt reaches the model as written: the default model's chat template joins
    # the messages' text (a completion model has no roles).
    path = default_checkpoint()
    assert one["prompt_token_ids"] == load_tokenizer(path).encode("The")
    eos = json.loads((path / "config.json").read_text())["eos_token_id"]
    assert one["token_ids"] == mlx_lm_greedy_ids(one["prompt_token_ids"], 48, eos)

    stages = run_json([*ARGS, "--stages", "2"])
    ring = run_json(ARGS, ranks=2)
    for split in (stages, ring):
        assert split["text"] == one["text"] and split["token_ids"] == one["token_ids"]
        assert split["logprobs"] == pytest.approx(one["logprobs"], abs=1e-4)
        assert [r["layers"] for r in split["ranks"]] == [[0, 3], [3, 6]]
    assert [r["rank"] for r in ring["ranks"]] == [0, 1]


def test_the_default_model_has_trinitys_features():
    config = json.loads((default_checkpoint() / "config.json").read_text())
    assert {"sliding_attention", "full_attention"} == set(config["layer_types"])
    assert config["num_dense_layers"] >= 1 and config["num_experts"] > config["num_experts_per_tok"] > 1
    assert config["num_shared_experts"] == 1 and config["mup_enabled"] is True
    weights = mx.load(str(default_checkpoint() / "model.safetensors"))
    assert all(v.dtype == mx.float32 for v in weights.values())
    # Balanced, not left at zero: the router's bias was trained as Trinity's is.
    biases = [v for k, v in weights.items() if k.endswith("mlp.expert_bias")]
    assert biases and all(mx.abs(b).max().item() > 0 for b in biases)


def test_the_default_template_takes_tools_and_joins_text_as_before():
    """Agents always send tools: the embedded model's template takes them (a json_tools header, calls as
    <tool_call>…</tool_call>: mlx-lm's json_tools parser), and without tools joins the text as written."""
    tokenizer = load_tokenizer(default_checkpoint())
    assert tokenizer.has_tool_calling and tokenizer.tool_call_start == "<tool_call>"
    turns = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "The"}]
    plain = "{% for message in messages %}{{ message['content'] }}{% if not loop.last %}\n\n{% endif %}{% endfor %}"
    for messages in (turns[1:], turns, turns + [{"role": "assistant", "content": " ok\n"}, {"role": "user", "content": "x"}]):
        assert tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) \
            == tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, chat_template=plain)
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    history = turns + [{"role": "assistant", "content": None, "tool_calls": [{"id": "c", "type": "function",
                                                                              "function": {"name": "f", "arguments": {}}}]},
                       {"role": "tool", "tool_call_id": "c", "content": "42"}]
    text = tokenizer.apply_chat_template(history, tools=tools, tokenize=False, add_generation_prompt=True)
    assert text.startswith("# Tools\n<tools>\n") and '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call>' in text
    assert text.endswith("<tool_response>\n42\n</tool_response>")
