"""config.json into mlx-lm's ModelArgs (shard/config.py), written either way the family's
configs are: transformers v5's rope_parameters or rope_theta / rope_scaling; layer_types
given or derived from global_attn_every_n_layers; explicit values kept."""

import pytest

from distributed import TrinityError
from distributed.shard.config import model_args

BASE = {"model_type": "afmoe", "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 8, "num_attention_heads": 4,
        "head_dim": 16, "route_scale": 1.5, "sliding_window": 512}


def test_rope_parameters_and_rope_theta_give_the_same_args():
    v5 = model_args({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 50000.0}})
    v4 = model_args({**BASE, "rope_theta": 50000.0})
    assert v5 == v4 and v5.rope_theta == 50000.0 and v5.rope_scaling is None
    yarn = {"rope_type": "yarn", "rope_theta": 50000.0, "factor": 4.0, "original_max_position_embeddings": 4096}
    assert model_args({**BASE, "rope_parameters": yarn}).rope_scaling == yarn


@pytest.mark.parametrize("config", [{"rope_parameters": {"rope_type": "wavy", "rope_theta": 1.0}},
                                    {"rope_theta": 1.0, "rope_scaling": {"type": "wavy", "factor": 2}}])
def test_a_rope_type_mlx_lm_cannot_do_is_one_line_naming_it(config):
    with pytest.raises(TrinityError, match=r"^config.json's RoPE type 'wavy' is not one mlx-lm implements \(default, "):
        model_args({**BASE, **config})


def test_layer_types_derived_or_given_and_explicit_values_kept():
    derived = model_args({**BASE, "global_attn_every_n_layers": 2})
    assert derived.layer_types == ["sliding_attention", "full_attention"] * 4
    given = ["full_attention"] * 8
    assert model_args({**BASE, "layer_types": given, "global_attn_every_n_layers": 2}).layer_types == given
    assert model_args(BASE).layer_types[3::4] == ["full_attention"] * 2  # every 4th by default
    args = model_args(BASE)
    assert (args.head_dim, args.route_scale, args.sliding_window) == (16, 1.5, 512)  # not mlx-lm's defaults
    with pytest.raises(TrinityError, match="7 layer_types for 8 layers"):
        model_args({**BASE, "layer_types": given[:7]})
