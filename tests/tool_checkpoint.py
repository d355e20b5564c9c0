"""Tiny AFMoE checkpoints whose greedy chat answer is fixed: one that calls a tool (a chat
template that takes `tools`, in either form mlx-lm's tokenizer loader recognises: its
json_tools parser's `<tool_call>{"name": …, "arguments": …}</tool_call>`, or
qwen3_coder's `<tool_call><function=NAME><parameter=P>value</parameter></function></tool_call>`),
and one that thinks (`<think>` and `</think>` tokens, so mlx-lm's TokenizerWrapper has
`has_thinking`, and a template whose generation prompt opens a think, as
Trinity-Thinking's does, and that renders an assistant's `reasoning_content` inside one).

The weights are the tiny checkpoint's with every layer's output projections (o_proj,
down_proj) zero, so the layers add nothing to the residual stream and each position's
output depends on its own token alone: the model is a bigram table. The embedding and
lm_head are then set so that greedy decoding follows a chain of tokens (most of them
added to the tokenizer): for the tool checkpoint "\\n" (the end of
"<|im_start|>assistant\\n") -> "<tool_call>" -> CALL -> "</tool_call>" -> "<|im_end|>";
for the thinking one "\\n" (after "<think>") -> REASONING… -> "</think>" -> ANSWER… ->
"<|im_end|>".
"""

import json
from pathlib import Path

import mlx.core as mx

from distributed.shard.tiny_checkpoint import make_checkpoint

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ADDED = ["<tool_call>", json.dumps(CALL), "</tool_call>"]  # json_tools: the chain's added tokens
QWEN3_CALL = "\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n</function>\n"
QWEN3_ADDED = ["<tool_call>", QWEN3_CALL, "</tool_call>"]
REASONING = ["The user asks about Paris.", " Say it is sunny."]
ANSWER = ["It is sunny", " in Paris."]
THINK_ADDED = ["<think>", *REASONING, "</think>", *ANSWER]

SYSTEM = "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
TOOLS_HEADER = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n")
TURNS = (
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
HOWTO = {  # the tools header's last line, and how an assistant's calls render, in each form
    "json_tools": ("Call a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n",
                   "{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}<tool_call>\n"
                   "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>"
                   "{% endfor %}"),
    "qwen3_coder": ("Call a function with <tool_call>\n<function=NAME>\n<parameter=P>\nvalue\n</parameter>\n"
                    "</function>\n</tool_call>.<|im_end|>\n",
                    "{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}<tool_call>\n"
                    "<function={{ tool_call.name }}>\n{% for name, value in tool_call.arguments.items() %}"
                    "<parameter={{ name }}>\n{{ value }}\n</parameter>\n{% endfor %}</function>\n</tool_call>"
                    "{% endfor %}"),
}
REASONING_JINJA = "{% if message.reasoning_content %}<think>\n{{ message.reasoning_content }}\n</think>\n{% endif %}"
OPEN_THINK = "{% if enable_thinking is not defined or enable_thinking %}<think>\n{% endif %}"


def tool_template(form: str, thinking: bool = False) -> str:
    """A chat template taking tools in `form`'s syntax (mlx-lm infers json_tools from "<tool_call>"
    and "tool_call.name", qwen3_coder from "<tool_call>\\n<function="); `thinking`: an assistant's
    reasoning inside <think>, and a generation prompt that opens one."""
    howto, calls = HOWTO[form]
    assistant = ("{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
                 if not thinking else "{%- elif message.role == 'assistant' %}<|im_start|>assistant\n" + REASONING_JINJA)
    calls = calls if not thinking else "{% if message.tool_calls %}" + calls + "{% endif %}"
    template = (TOOLS_HEADER + howto + SYSTEM + "{%- for message in messages %}"
                "{%- if message.role == 'system' and loop.first %}" + assistant
                + "{% if message.content %}{{ message.content }}{% endif %}" + calls + "<|im_end|>\n" + TURNS)
    return template.removesuffix("{% endif %}") + OPEN_THINK + "{% endif %}" if thinking else template


TOOL_TEMPLATE, QWEN3_TEMPLATE = tool_template("json_tools"), tool_template("qwen3_coder")
THINK_TEMPLATE = (  # Qwen3 / Trinity-Thinking style: reasoning inside <think>, the generation prompt opens one
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n"
    + REASONING_JINJA + "{{ message.content or '' }}<|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n" + OPEN_THINK + "{% endif %}")
FORMS = {"json_tools": (ADDED, TOOL_TEMPLATE), "qwen3_coder": (QWEN3_ADDED, QWEN3_TEMPLATE)}


def make_tool_checkpoint(path, form: str = "json_tools") -> Path:
    """A checkpoint that answers a chat turn with one get_weather call, in `form`'s syntax."""
    added, template = FORMS[form]
    return _chain_checkpoint(path, added, template, ["\n", *added, "<|im_end|>"])


def make_think_checkpoint(path, form: str = None) -> Path:
    """A checkpoint that thinks REASONING, then answers ANSWER; with a tool-call `form`, its
    template takes tools too and, after the same reasoning, it calls get_weather instead."""
    if form is None:
        return _chain_checkpoint(path, THINK_ADDED, THINK_TEMPLATE, ["\n", *THINK_ADDED[1:], "<|im_end|>"])
    added = FORMS[form][0]
    return _chain_checkpoint(path, ["<think>", *REASONING, "</think>", *added], tool_template(form, thinking=True),
                             ["\n", *REASONING, "</think>", *added, "<|im_end|>"])


def _chain_checkpoint(path, added, template: str, links) -> Path:
    """Tokens `added`, chat template `template`, and weights whose greedy next token after each
    of `links` is the one after it (a token's text names it: a byte or an added token)."""
    from tokenizers import AddedToken, Tokenizer

    path = make_checkpoint(Path(path))
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in dict.fromkeys(added)])
    tokenizer.save(str(path / "tokenizer.json"))
    config_path, tokenizer_config = path / "config.json", path / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "chat_template": template}))
    config = json.loads(config_path.read_text())
    config["vocab_size"] = vocab = tokenizer.get_vocab_size()
    config_path.write_text(json.dumps(config, indent=2))

    chain = [tokenizer.token_to_id(t) if tokenizer.token_to_id(t) is not None else tokenizer.encode(t).ids[0]
             for t in links]
    for file in sorted(path.glob("*.safetensors")):
        weights = mx.load(str(file))
        for key, value in weights.items():
            if key.endswith(("o_proj.weight", "down_proj.weight")):
                weights[key] = mx.zeros_like(value)
        if "model.embed_tokens.weight" in weights:
            embed = weights["model.embed_tokens.weight"]
            embed = mx.concatenate([embed, embed[: vocab - embed.shape[0]]])  # rows for the added tokens
            for k, token in enumerate(chain[:-1]):  # each link's source: a basis vector of its own
                embed[token] = mx.zeros(embed.shape[1]).at[k].add(1.0)
            weights["model.embed_tokens.weight"] = embed
        if "lm_head.weight" in weights:
            head = mx.zeros((vocab, weights["lm_head.weight"].shape[1]))
            for k, token in enumerate(chain[1:]):
                head[token] = mx.zeros(head.shape[1]).at[k].add(10.0)
            weights["lm_head.weight"] = head
            weights["model.norm.weight"] = mx.ones_like(weights["model.norm.weight"])
        mx.save_safetensors(str(file), weights, metadata={"format": "pt"})
    return path


def make_short_answer_checkpoint(path, answer: str = "Hi there!") -> Path:
    """The embedded default model's tokenizer, chat template and context (65,536 tokens), as a
    2-layer bigram table (one sliding-attention layer, one full) whose reply to any prompt is
    `answer` then end of text, even when sampled at temperature 1: a coding agent's long first
    prompt is served as the default model would serve it, without the minutes of text the real
    weights write at temperature 1 (the agents' tests)."""
    import shutil

    from distributed.shard.tiny_checkpoint import DEFAULT_MODEL
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(DEFAULT_MODEL / name, path / name)
    config = json.loads((DEFAULT_MODEL / "config.json").read_text())
    config.update(num_hidden_layers=2, layer_types=["sliding_attention", "full_attention"])
    (path / "config.json").write_text(json.dumps(config, indent=2))
    weights = {k: v for k, v in mx.load(str(DEFAULT_MODEL / "model.safetensors")).items()
               if not k.startswith("model.layers.") or int(k.split(".")[2]) < 2}
    for key, value in weights.items():
        if key.endswith(("o_proj.weight", "down_proj.weight")):
            weights[key] = mx.zeros_like(value)
    from tokenizers import Tokenizer
    chain = Tokenizer.from_file(str(path / "tokenizer.json")).encode(answer).ids
    assert len(set(chain)) == len(chain), answer  # a bigram table: each token of the answer once
    basis = mx.eye(config["hidden_size"])  # state k: the k-th basis vector
    embed = mx.repeat(basis[:1], weights["model.embed_tokens.weight"].shape[0], axis=0)  # every token: "before the answer"
    head = mx.zeros(weights["lm_head.weight"].shape)
    for k, token in enumerate(chain):
        embed[token] = basis[k + 1]  # the answer's token k: state k + 1
        head[token] = 10.0 * basis[k]  # after state k comes the answer's token k
    head[config["eos_token_id"]] = 10.0 * basis[len(chain)]
    weights.update({"model.embed_tokens.weight": embed, "lm_head.weight": head,
                    "model.norm.weight": mx.ones_like(weights["model.norm.weight"])})
    mx.save_safetensors(str(path / "model.safetensors"), weights, metadata={"format": "pt"})
    return path
