"""A tiny AFMoE checkpoint that calls a tool: a chat template that takes `tools` (in
the form mlx-lm's tokenizer loader recognises: its json_tools parser), and weights
that always answer a chat turn with one call.

The weights are the tiny checkpoint's with every layer's output projections
(o_proj, down_proj) zero, so the layers add nothing to the residual stream and
each position's output depends on its own token alone: the model is a bigram
table. The embedding and lm_head are then set so that greedy decoding follows
"\\n" (the end of "<|im_start|>assistant\\n") -> "<tool_call>" -> CALL ->
"</tool_call>" -> "<|im_end|>", where the three are tokens added to the tokenizer.
"""

import json
from pathlib import Path

import mlx.core as mx

from distributed.shard.tiny_checkpoint import make_checkpoint

CALL = {"name": "get_weather", "arguments": {"city": "Paris"}}
ADDED = ["<tool_call>", json.dumps(CALL), "</tool_call>"]
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    "Call a function with <tool_call>{\"name\": ..., \"arguments\": ...}</tool_call>.<|im_end|>\n"
    "{% elif messages[0].role == 'system' %}<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}<|im_start|>assistant\n"
    "{% if message.content %}{{ message.content }}{% endif %}"
    "{%- for tool_call in message.tool_calls %}{% set tool_call = tool_call.function %}<tool_call>\n"
    "{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}\n</tool_call>"
    "{% endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def make_tool_checkpoint(path) -> Path:
    from tokenizers import AddedToken, Tokenizer

    path = make_checkpoint(Path(path))
    tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in ADDED])
    tokenizer.save(str(path / "tokenizer.json"))
    config_path, tokenizer_config = path / "config.json", path / "tokenizer_config.json"
    tokenizer_config.write_text(json.dumps({**json.loads(tokenizer_config.read_text()), "chat_template": TOOL_TEMPLATE}))
    config = json.loads(config_path.read_text())
    config["vocab_size"] = vocab = tokenizer.get_vocab_size()
    config_path.write_text(json.dumps(config, indent=2))

    chain = [tokenizer.encode("\n").ids[0], *(tokenizer.token_to_id(t) for t in ADDED), tokenizer.token_to_id("<|im_end|>")]
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
