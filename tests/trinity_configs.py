"""Trinity-Mini and Trinity-Nano config.json shapes, as the launch tests assume them.

Mini: the model card's figures (as launch/configs/presets/trinity-mini.json). Nano: "56 layers, hidden 1024, 8/2 heads, moe_intermediate 256,
otherwise alike"; assumed here: head_dim 128 (as Mini), intermediate_size 3072 (3 x hidden, as
Mini's 6144 = 3 x 2048), 2 dense layers, 128 experts top-8, 1 shared expert, vocab 200192,
window 2048, untied embeddings; this comes to about 6.1B parameters, the published "6B".
"""


def layer_types(n):
    return ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(n)]


def _common(**kw):
    c = {
        "model_type": "afmoe", "vocab_size": 200192, "head_dim": 128, "num_experts": 128,
        "num_experts_per_tok": 8, "num_shared_experts": 1, "num_dense_layers": 2,
        "sliding_window": 2048, "max_position_embeddings": 131072, "tie_word_embeddings": False,
        "rope_theta": 10000.0, "rms_norm_eps": 1e-5, "mup_enabled": True, "torch_dtype": "bfloat16",
    }
    c.update(kw)
    c["layer_types"] = layer_types(c["num_hidden_layers"])
    return c


def mini():
    return _common(num_hidden_layers=32, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4,
                   intermediate_size=6144, moe_intermediate_size=1024)


def nano():
    return _common(num_hidden_layers=56, hidden_size=1024, num_attention_heads=8, num_key_value_heads=2,
                   intermediate_size=3072, moe_intermediate_size=256)


# Worked by hand from the configs (trinity_configs.py), bf16 = 2 bytes:
#   attention: q (heads*128, H) + k, v (kv*128, H) + gate (heads*128, H) + o (H, heads*128), + q/k norms 2*128
#   dense MLP: 3 * intermediate * H; MoE: router (128, H) + expert_bias 128 float32
#              + 128 experts * 3 * moe_inter * H + shared 3 * moe_inter * H
#   4-bit, group 64: (out, in) -> out*in/2 packed + scales and biases 2 * out*in/64 * 2 bytes
#   router at 8 bits: out*in + 2 * out*in/64 * 2
MINI_BF16 = {
    "attention": (4096 * 2048 * 3 + 512 * 2048 * 2) * 2 + 2 * 128 * 2,  # 54_526_464
    "dense_mlp": 3 * 6144 * 2048 * 2,  # 75_497_472
    "experts": 128 * 2048 * 2 + 128 * 4 + 128 * 3 * 1024 * 2048 * 2 + 3 * 1024 * 2048 * 2,  # 1_623_720_448
    "norms": 4 * 2048 * 2,
    "embed_head": 2 * 200192 * 2048 * 2 + 2048 * 2,  # embedding + lm_head (untied) + final norm
}
NANO_BF16 = {
    "attention": (1024 * 1024 * 3 + 256 * 1024 * 2) * 2 + 2 * 128 * 2,  # 7_340_544
    "dense_mlp": 3 * 3072 * 1024 * 2,
    "experts": 128 * 1024 * 2 + 128 * 4 + 128 * 3 * 256 * 1024 * 2 + 3 * 256 * 1024 * 2,  # 203_162_112
    "norms": 4 * 1024 * 2,
    "embed_head": 2 * 200192 * 1024 * 2 + 1024 * 2,
}


def q4(o, i):
    return o * i // 2 + 2 * (o * i // 64) * 2


def q8(o, i):
    return o * i + 2 * (o * i // 64) * 2


MINI_Q4 = {
    "attention": q4(4096, 2048) * 3 + q4(512, 2048) * 2 + 2 * 128 * 2,  # 15_335_936
    "dense_mlp": 3 * q4(6144, 2048),
    "experts": q8(128, 2048) + 128 * 4 + 128 * 3 * q4(1024, 2048) + 3 * q4(1024, 2048),  # 456_802_816
    "norms": 4 * 2048 * 2,
    "embed_head": 2 * q4(200192, 2048) + 2048 * 2,
}
KV_PER_TOKEN = {"mini": 2 * 4 * 128 * 2, "nano": 2 * 2 * 128 * 2}  # K and V, KV heads, head_dim, bf16


def hand_layer(table, layer, num_dense=2):
    mlp = table["dense_mlp"] if layer < num_dense else table["experts"]
    return table["attention"] + table["norms"] + mlp


def hand_cache(kind, start, end, context, window=2048):
    # layer_types: 3 sliding then 1 full; sliding layers hold at most the window.
    return sum(KV_PER_TOKEN[kind] * (context if (l + 1) % 4 == 0 else min(context, window)) for l in range(start, end))
