"""The presets and example hostfiles installed with the package, found by name."""

import pytest

from distributed import TrinityError
from launch import bundled


def test_by_name_with_or_without_json_and_files_first(tmp_path, monkeypatch):
    mini = bundled.resolve("preset", "trinity-mini")
    assert mini == bundled.CONFIGS / "presets" / "trinity-mini.json" and mini.is_file()
    assert bundled.resolve("preset", "trinity-mini.json") == mini
    assert bundled.resolve("hostfile", "localhost-2") == bundled.CONFIGS / "hosts" / "localhost-2.json"
    assert "thunderbolt-ring-2macs" in bundled.names("hostfile") and bundled.names("preset") == [
        "trinity-large", "trinity-mini", "trinity-nano"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "localhost-2").write_text("[]")  # a file of the user's wins over a bundled name
    assert bundled.resolve("hostfile", "localhost-2").resolve() == (tmp_path / "localhost-2").resolve()


def test_a_missing_path_is_not_taken_for_a_name():
    with pytest.raises(TrinityError, match="hostfile configs/hosts/localhost-2.json does not exist"):
        bundled.resolve("hostfile", "configs/hosts/localhost-2.json")
    with pytest.raises(TrinityError, match=r"\(bundled: trinity-large, trinity-mini, trinity-nano\)"):
        bundled.resolve("preset", "mini")


def test_trinity_large_by_its_other_names_with_its_known_shape():
    large = bundled.resolve("preset", "trinity-large")
    assert all(bundled.resolve("preset", name) == large for name in
               ("trinity-large-thinking", "trinity-large-base", "trinity-large-preview"))
    import json

    from distributed.shard.config import model_args

    args = model_args(json.loads(large.read_text())["config"])
    assert (args.hidden_size, args.num_hidden_layers, args.num_dense_layers, args.head_dim) == (3072, 60, 6, 128)
    assert (args.num_attention_heads, args.num_key_value_heads, args.num_experts, args.num_experts_per_tok,
            args.num_shared_experts) == (48, 8, 256, 4, 1)
    assert (args.intermediate_size, args.moe_intermediate_size, args.sliding_window) == (12288, 3072, 4096)
    assert args.layer_types[3::4] == ["full_attention"] * 15 and args.layer_types.count("sliding_attention") == 45
