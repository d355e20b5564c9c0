"""The model presets and example hostfiles installed with the package (launch/configs/),
found by name from any directory: `--preset trinity-mini`, `--hostfile localhost-2`; a preset
also by one of its "aliases" (`--preset trinity-large-thinking`)."""

import json
from pathlib import Path
from typing import List

from distributed import TrinityError

CONFIGS = Path(__file__).resolve().parent / "configs"
FOLDERS = {"preset": "presets", "hostfile": "hosts"}


def names(kind: str) -> List[str]:
    return sorted(p.stem for p in (CONFIGS / FOLDERS[kind]).glob("*.json"))


def resolve(kind: str, name: str) -> Path:
    """`name` as a path if that file exists; else the bundled file of that name
    (`.json` optional). A missing file that looks like a path is named as such."""
    path = Path(name).expanduser()
    if path.exists():
        return path
    bundled = CONFIGS / FOLDERS[kind] / (path.name if path.suffix == ".json" else f"{path.name}.json")
    if len(path.parts) == 1 and bundled.exists():
        return bundled
    if kind == "preset" and len(path.parts) == 1:  # a preset's other names (its "aliases")
        for preset in sorted((CONFIGS / FOLDERS[kind]).glob("*.json")):
            if path.stem in json.loads(preset.read_text()).get("aliases", []):
                return preset
    raise TrinityError(f"{kind} {name} does not exist, and no bundled {kind} has that name "
                       f"(bundled: {', '.join(names(kind))})")
