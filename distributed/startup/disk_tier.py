"""A rank's disk tier of prefix-cache entries (runtime/disk_cache.py), opened at start-up from
the command line: only where a prefix cache can be on (--serve, --chat; not --prefix-cache-bytes 0
nor --prefix-cache-dir none), in the folder given or the user's cache folder, fingerprinted with
what this rank holds (the checkpoint, its dtype, its layers and its tensor share)."""

from pathlib import Path
from typing import Optional, Tuple

from ..runtime.disk_cache import DiskCache, default_disk_bytes, default_folder, fingerprint
from ..shard.stage import Stage
from .settings import Settings


def open_disk_tier(settings: Settings, path: Path, config: dict, stage: Stage,
                   tensor: Optional[Tuple[int, int]] = None) -> Optional[DiskCache]:
    """This rank's disk tier, or None. `tensor`: (rank in its group, group size)."""
    sizing = settings.sizing
    serving = settings.serving.wanted or settings.generation.chat
    if not serving or sizing.prefix_cache_bytes == 0 or (sizing.prefix_cache_dir or "").lower() == "none":
        return None
    folder = Path(sizing.prefix_cache_dir).expanduser() if sizing.prefix_cache_dir else default_folder()
    limit = sizing.prefix_cache_disk_bytes
    limit = default_disk_bytes(folder) if limit is None else limit
    if limit <= 0:
        return None
    dtype = stage.layers[0].input_layernorm.weight.dtype
    return DiskCache(folder, limit, fingerprint(Path(path), config, str(dtype), (stage.start, stage.end), tensor))
