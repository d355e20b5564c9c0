"""The presets and example hostfiles installed with the package, found by name."""

import pytest

from distributed import TrinityError
from launch import bundled


def test_by_name_with_or_without_json_and_files_first(tmp_path, monkeypatch):
    mini = bundled.resolve("preset", "trinity-mini")
    assert mini == bundled.CONFIGS / "presets" / "trinity-mini.json" and mini.is_file()
    assert bundled.resolve("preset", "trinity-mini.json") == mini
    assert bundled.resolve("hostfile", "localhost-2") == bundled.CONFIGS / "hosts" / "localhost-2.json"
    assert "thunderbolt-ring-2macs" in bundled.names("hostfile") and bundled.names("preset") == ["trinity-mini",
                                                                                                   "trinity-nano"]
    monkeypatch.chdir(tmp_path)
    (tmp_path / "localhost-2").write_text("[]")  # a file of the user's wins over a bundled name
    assert bundled.resolve("hostfile", "localhost-2").resolve() == (tmp_path / "localhost-2").resolve()


def test_a_missing_path_is_not_taken_for_a_name():
    with pytest.raises(TrinityError, match="hostfile configs/hosts/localhost-2.json does not exist"):
        bundled.resolve("hostfile", "configs/hosts/localhost-2.json")
    with pytest.raises(TrinityError, match=r"\(bundled: trinity-mini, trinity-nano\)"):
        bundled.resolve("preset", "mini")
