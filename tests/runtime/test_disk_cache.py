"""The prefix cache's disk tier (runtime/disk_cache.py), on real files with real mlx-lm caches:
round trips, fingerprints, damaged and vanished files, a read-only folder and a full disk (real
tmpfs mounts, as root), the folder's permissions, LRU eviction under the byte bound, a writer
queue that drops rather than blocks, and two servers sharing one folder."""

import json
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.models.cache import KVCache, RotatingKVCache

from distributed.runtime import disk_cache
from distributed.runtime.disk_cache import DiskCache, chain_hashes, default_disk_bytes, default_folder, fingerprint
from conftest import needs
from mounts import remount, tmpfs

ROOT = Path(__file__).resolve().parents[2]
FP = "a" * 64
OTHER = "b" * 64
HEADS, DIM, WINDOW = 2, 16, 16
GiB = 2**30


def pair(n, rng, dtype=mx.float32):
    return tuple(mx.array(rng.standard_normal((1, HEADS, n, DIM)).astype(np.float32)).astype(dtype) for _ in "kv")


def full(n, rng, dtype=mx.float32):
    """A KVCache as a prefill and a decode step leave it: padded past its offset."""
    c = KVCache()
    c.update_and_fetch(*pair(n - 1, rng, dtype))
    c.update_and_fetch(*pair(1, rng, dtype))
    mx.eval(c.keys, c.values)
    return c


def rotating(n, rng, window=WINDOW):
    """A RotatingKVCache after a prefill and up to three decode steps: wrapped where n > window."""
    c = RotatingKVCache(window)
    first = max(1, n - 3)
    c.update_and_fetch(*pair(first, rng))
    for _ in range(n - first):
        c.update_and_fetch(*pair(1, rng))
    mx.eval(c.keys, c.values)
    return c


def entry(n, seed=0):
    rng = np.random.default_rng(seed)
    return np.arange(n, dtype=np.int32) + 1000 * seed, [full(n, rng), rotating(n, rng), full(n, rng), rotating(n, rng)]


def assert_same(expected, got):
    """Equal state, and the same next step: the restored caches go on as the stored ones would."""
    assert len(expected) == len(got)
    rng = np.random.default_rng(99)
    for a, b in zip(expected, got):
        assert type(a) is type(b) and a.offset == b.offset
        if isinstance(a, KVCache):
            arrays = [(a.keys[..., : a.offset, :], b.keys), (a.values[..., : a.offset, :], b.values)]
        else:
            assert (a.keep, a.max_size, a._idx) == (b.keep, b.max_size, b._idx)
            arrays = [(a.keys, b.keys), (a.values, b.values)]
        for x, y in arrays:
            assert x.dtype == y.dtype and x.shape == y.shape and mx.array_equal(x, y).item()
        again = type(a).from_state(tuple(mx.array(s) if isinstance(s, mx.array) else s for s in a.state))
        k, v = pair(1, rng, a.keys.dtype)
        for x, y in zip(again.update_and_fetch(k, v), b.update_and_fetch(k, v)):
            assert mx.array_equal(x, y).item()


def path_of(cache, key):
    return cache.sub / (key + ".safetensors")


def stored(folder, key="k0", n=40, seed=0, fp=FP, **kwargs):
    """A cache in `folder` holding one entry, flushed."""
    cache = DiskCache(folder, kwargs.pop("max_bytes", GiB), fp, **kwargs)
    tokens, caches = entry(n, seed)
    assert cache.put(key, tokens, caches, {"seed": str(seed)})
    cache.flush()
    return cache, tokens, caches


def warnings_of(caplog):
    return [r.getMessage() for r in caplog.records
            if r.name == disk_cache.__name__ and r.levelno >= logging.WARNING]


# Round trips


def test_entries_round_trip_and_survive_a_restart(tmp_path):
    folder = tmp_path / "pc"
    cache = DiskCache(folder, GiB, FP)
    wrapped = entry(40, seed=1)  # more tokens than the window: the rotating caches have wrapped
    short = entry(10, seed=2)  # fewer: not wrapped
    rng = np.random.default_rng(3)
    half = (np.arange(20, dtype=np.int32), [full(20, rng, mx.bfloat16), rotating(20, rng)])
    for key, (tokens, caches) in {"wrapped": wrapped, "short": short, "bf16": half}.items():
        assert cache.put(key, tokens, caches, {"key": key})
        cache.flush()  # the queue holds two: a third put drops while the writer is behind
    assert cache.stats()["writes"] == 3 and cache.holds("wrapped")
    for key, (tokens, caches) in {"wrapped": wrapped, "short": short, "bf16": half}.items():
        got_tokens, got, meta = cache.get(key)
        assert np.array_equal(got_tokens, tokens) and got_tokens.dtype == np.int32 and meta == {"key": key}
        assert_same(caches, got)
    assert cache.get("absent") is None
    stats = cache.stats()
    assert (stats["hits"], stats["misses"], stats["reads"], stats["entries"]) == (3, 1, 4, 3)
    assert stats["bytes"] == sum(p.stat().st_size for p in cache.sub.iterdir()) and stats["read_seconds"] > 0
    cache.close()
    assert not cache.enabled and cache.put("late", *short) is False

    again = DiskCache(folder, GiB, FP)  # a restart: the scan finds every entry, their tokens from the headers
    assert {k: v.tolist() for k, v in again.entries().items()} == {
        "wrapped": wrapped[0].tolist(), "short": short[0].tolist(), "bf16": half[0].tolist()}
    assert_same(wrapped[1], again.get("wrapped")[1])
    again.remove("short")
    assert not again.holds("short") and again.get("short") is None and "short" not in again.entries()
    again.close()


def test_a_cache_of_a_prefix_of_the_tokens_travels_too(tmp_path):
    """caches.Stored's log (a sliding layer's unrotated keys of its first tokens) as a KVCache."""
    cache = DiskCache(tmp_path / "pc", GiB, FP)
    tokens, caches = entry(40)
    caches.append(full(24, np.random.default_rng(4)))
    assert cache.put("k", tokens, caches, {"logged": "24"})
    cache.flush()
    got_tokens, got, meta = cache.get("k")
    assert np.array_equal(got_tokens, tokens) and meta == {"logged": "24"} and got[-1].offset == 24
    assert_same(caches, got)
    cache.close()


def read_bytes() -> int:
    """Bytes this process has read through read(2)-like calls so far (the kernel counts them)."""
    return int(dict(line.split(": ") for line in Path("/proc/self/io").read_text().splitlines())["rchar"])


def test_a_range_reads_only_the_pieces_it_spans(tmp_path):
    """EntryFile.read gives exactly the positions asked for, reading the pieces they span (a
    piece: PIECE positions of one head) and no more: damage elsewhere is never read, damage
    inside them is found (a counted miss, the file removed)."""
    piece = disk_cache.PIECE
    n = 3 * piece + 100
    c = KVCache()
    c.keys, c.values = pair(n, np.random.default_rng(5))
    c.offset = n
    cache = DiskCache(tmp_path / "pc", GiB, FP)
    assert cache.put("k", np.arange(n, dtype=np.int32), [c])
    cache.flush()
    size = path_of(cache, "k").stat().st_size
    for start, end in [(0, n), (5, 17), (piece - 1, piece + 1), (2 * piece, n), (n - 1, n)]:
        before = read_bytes()
        keys, values = cache.read("k", lambda f: f.read([(0, start, end)])[0])
        spanned = min(n, -(-end // piece) * piece) - start // piece * piece
        data = 2 * HEADS * spanned * DIM * 4  # keys and values, float32
        assert data <= read_bytes() - before < data + 16384 + (size if (start, end) == (0, n) else 0) // 8
        assert mx.array_equal(keys, c.keys[..., start:end, :]).item()
        assert mx.array_equal(values, c.values[..., start:end, :]).item()
    with open(path_of(cache, "k"), "rb") as f:
        tensors, _, data_start = disk_cache.parse_header(f, size)
    last = data_start + tensors["0.0"][2] + (n - 1) * DIM * 4  # keys, head 0, the last position
    with open(path_of(cache, "k"), "r+b") as f:
        f.seek(last)
        byte = f.read(1)
        f.seek(last)
        f.write(bytes([byte[0] ^ 1]))
    assert cache.read("k", lambda f: f.read([(0, 5, 17)])) is not None  # the damaged piece is not read
    assert cache.read("k", lambda f: f.read([(0, n - 10, n)])) is None
    assert cache.stats()["corrupt"] == 1 and not path_of(cache, "k").exists()
    cache.close()


def test_what_is_queued_is_the_state_at_put(tmp_path):
    """The caller's caches go on (in-place updates) while the writer has not written yet."""
    cache = DiskCache(tmp_path / "pc", GiB, FP)
    tokens, caches = entry(40)
    before = [type(c).from_state(tuple(mx.array(s) if isinstance(s, mx.array) else s for s in c.state))
              for c in caches]
    assert cache.put("k", tokens, caches)
    rng = np.random.default_rng(5)
    for c in caches:
        c.update_and_fetch(*pair(1, rng))
        c.keys[..., :1, :] = 7.0
    mx.eval([c.state for c in caches])
    cache.flush()
    assert_same(before, cache.get("k")[1])
    cache.close()


def test_put_refuses_caches_it_cannot_store(tmp_path):
    cache = DiskCache(tmp_path / "pc", GiB, FP)
    tokens, caches = entry(12)
    with pytest.raises(ValueError):  # a cache of more tokens than the entry's
        cache.put("k", tokens[:-1], caches)
    with pytest.raises(TypeError):
        cache.put("k", tokens, [object()])
    small = DiskCache(tmp_path / "small", 1000, FP)  # an entry larger than the whole bound
    assert small.put("k", tokens, caches) is False and small.stats()["write_drops"] == 1
    for c in (cache, small):
        c.close()


def test_keys_that_are_not_plain_names_stay_in_the_subfolder(tmp_path):
    cache, tokens, caches = stored(tmp_path / "pc", key="../../escape me")
    assert [p.parent for p in (tmp_path / "pc").rglob("*.safetensors")] == [cache.sub]
    assert cache.holds("../../escape me") and cache.get("../../escape me") is not None
    cache.close()
    assert list(DiskCache(tmp_path / "pc", GiB, FP).entries()) == ["../../escape me"]


# Fingerprints


def test_another_fingerprint_finds_nothing_and_a_misplaced_file_is_removed(tmp_path, caplog):
    folder = tmp_path / "pc"
    mine, tokens, caches = stored(folder)
    other = DiskCache(folder, GiB, OTHER)
    assert other.entries() == {} and not other.holds("k0") and other.get("k0") is None
    assert other.stats()["fingerprint_mismatches"] == 0  # not in its subfolder: a plain miss

    shutil.copy(path_of(mine, "k0"), path_of(other, "k0"))  # a file copied into the wrong subfolder
    assert other.get("k0") is None
    assert other.stats()["fingerprint_mismatches"] == 1 and not path_of(other, "k0").exists()

    shutil.copy(path_of(mine, "k0"), path_of(other, "k0"))
    third = DiskCache(folder, GiB, OTHER)  # found by the scan at start
    assert third.entries() == {} and third.stats()["fingerprint_mismatches"] == 1
    assert not path_of(other, "k0").exists()
    assert_same(caches, mine.get("k0")[1])  # the owner's entry is untouched
    for c in (mine, other, third):
        c.close()


# Damaged and vanished files


def damage_at(path, at):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


def header_size(path):
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


@pytest.mark.parametrize("damage", ["truncated", "zero_length", "data_flipped", "length_flipped"])
def test_a_damaged_file_is_a_counted_miss_and_removed(tmp_path, caplog, damage):
    cache, tokens, caches = stored(tmp_path / "pc")
    path = path_of(cache, "k0")
    size = path.stat().st_size
    if damage == "truncated":
        os.truncate(path, size - 100)
    elif damage == "zero_length":
        os.truncate(path, 0)
    elif damage == "data_flipped":
        damage_at(path, (header_size(path) + size) // 2)
    else:
        damage_at(path, 2)  # the header's length
    assert cache.get("k0") is None
    stats = cache.stats()
    assert (stats["corrupt"], stats["misses"], stats["hits"]) == (1, 1, 0)
    assert not path.exists() and not cache.holds("k0") and "k0" not in cache.entries()
    assert any("damaged" in w for w in warnings_of(caplog))
    cache.close()


def test_flipped_bytes_never_give_wrong_data(tmp_path):
    """A flip anywhere (the header's JSON, our fields, the arrays) is caught: None, counted,
    removed; or, where it changes nothing that is read, the exact entry."""
    cache, tokens, caches = stored(tmp_path / "pc", n=24)
    path = path_of(cache, "k0")
    good = path.read_bytes()
    header = header_size(path)
    rng = np.random.default_rng(0)
    spots = sorted(set(np.linspace(8, header - 1, 60).astype(int)) | set(rng.integers(header, len(good), 20)))
    caught = 0
    for at in spots:
        path.write_bytes(good)
        damage_at(path, int(at))
        got = cache.get("k0")
        if got is None:
            caught += 1
            assert not path.exists()
        else:
            assert np.array_equal(got[0], tokens)
            assert_same(caches, got[1])
    assert caught >= len(spots) - 5  # nearly every byte matters
    stats = cache.stats()
    assert stats["corrupt"] + stats["fingerprint_mismatches"] == caught
    cache.close()


def test_damage_found_at_start_is_removed(tmp_path):
    folder = tmp_path / "pc"
    cache, _, _ = stored(folder)
    for key in ("k1", "k2"):
        cache.put(key, *entry(40))
    cache.flush()
    cache.close()
    os.truncate(path_of(cache, "k1"), 1000)
    path_of(cache, "k2").write_bytes(b"")
    again = DiskCache(folder, GiB, FP)
    assert list(again.entries()) == ["k0"] and again.stats()["corrupt"] == 2
    assert sorted(p.name for p in again.sub.iterdir()) == ["k0.safetensors"]
    again.close()


def test_a_file_deleted_mid_run_is_a_miss(tmp_path, monkeypatch):
    cache, tokens, caches = stored(tmp_path / "pc")
    assert cache.holds("k0")
    os.unlink(path_of(cache, "k0"))
    assert cache.get("k0") is None and not cache.holds("k0") and cache.entries() == {}

    cache.put("k1", tokens, caches)
    cache.flush()
    class DeletedMeanwhile(disk_cache.EntryFile):  # another server evicts it between our open and our reads
        def __init__(self, f, *args):
            os.unlink(f.name)
            super().__init__(f, *args)

    monkeypatch.setattr(disk_cache, "EntryFile", DeletedMeanwhile)
    got = cache.get("k1")  # the file opened is read whole: POSIX keeps it while it is open
    assert got is not None and np.array_equal(got[0], tokens)
    assert_same(caches, got[1])
    assert not cache.holds("k1") and cache.stats()["corrupt"] == 0
    monkeypatch.undo()

    shutil.rmtree(tmp_path / "pc")  # the whole folder, while the server runs
    assert not cache.holds("k0") and cache.get("k0") is None
    assert cache.put("k2", tokens, caches)
    cache.flush()
    assert cache.holds("k2") and (tmp_path / "pc").stat().st_mode & 0o777 == 0o700
    cache.close()


def test_stale_temporary_files_are_removed(tmp_path):
    cache, _, _ = stored(tmp_path / "pc")
    cache.close()
    stale, fresh = cache.sub / ".k9.1-aa.tmp.safetensors", cache.sub / ".k8.2-bb.tmp.safetensors"
    for path in (stale, fresh):
        path.write_bytes(b"partial")
    os.utime(stale, (time.time() - 2 * 3600,) * 2)
    again = DiskCache(tmp_path / "pc", GiB, FP)
    assert not stale.exists() and fresh.exists()  # another server may be writing that one now
    assert list(again.entries()) == ["k0"]
    again.close()


# A read-only folder and a full disk


def test_a_read_only_folder_costs_writes_only(tmp_path, caplog):
    with tmpfs(tmp_path / "mnt", "4m") as mnt:
        cache, tokens, caches = stored(mnt / "pc")
        remount(mnt, "ro")
        try:
            assert cache.put("k1", *entry(40, 1)) in (True, False)  # no raise
            cache.flush()
            assert cache.put("k2", *entry(40, 2)) is False  # writes pause after a failure
            stats = cache.stats()
            assert stats["write_errors"] == 1 and stats["write_drops"] == 1 and stats["writes"] == 1
            assert_same(caches, cache.get("k0")[1])  # what is there is still served
            assert cache.get("k1") is None
            assert not [p for p in cache.sub.iterdir() if p.name.startswith(".")]
            warned = warnings_of(caplog)
            assert len(warned) == 1 and "serving goes on from RAM" in warned[0]
            cache.close()

            caplog.clear()
            again = DiskCache(mnt / "pc", GiB, FP)  # a server started on the read-only folder
            assert again.enabled and not again.writable
            assert again.put("k3", *entry(40, 3)) is False
            assert_same(caches, again.get("k0")[1])
            warned = warnings_of(caplog)
            assert len(warned) == 1 and "read-only" in warned[0]
            again.close()
        finally:
            remount(mnt, "rw")


def test_a_full_disk_costs_writes_only(tmp_path, caplog):
    with tmpfs(tmp_path / "mnt", "2m") as mnt:
        cache = DiskCache(mnt / "pc", GiB, FP, retry_seconds=0)  # every write is tried
        rng = np.random.default_rng(0)
        tokens = np.arange(1024, dtype=np.int32)
        big = [full(1024, rng) for _ in range(2)]  # 1024 tokens x 2 heads x 16 x 4 bytes x 2 x 2: 512 KiB
        written = []
        for i in range(6):
            assert cache.put(f"k{i}", tokens, big)
            cache.flush()
            if cache.holds(f"k{i}"):
                written.append(f"k{i}")
        stats = cache.stats()
        assert 1 <= len(written) < 6 and stats["write_errors"] == 6 - len(written)
        warned = warnings_of(caplog)
        assert len(warned) == 1 and "serving goes on from RAM" in warned[0]
        assert not [p for p in cache.sub.iterdir() if p.name.startswith(".")]  # temporary files removed
        for key in written:
            assert_same(big, cache.get(key)[1])
        cache.remove(written[0])  # room again: writing goes on
        assert cache.put("again", tokens, big)
        cache.flush()
        assert cache.holds("again") and len(warnings_of(caplog)) == 1
        cache.close()


# The folder's permissions


def test_the_folder_is_private(tmp_path, caplog):
    new = tmp_path / "a" / "b" / "pc"
    cache = DiskCache(new, GiB, FP)
    assert cache.enabled and new.stat().st_mode & 0o777 == 0o700
    cache.put("k0", *entry(12))
    cache.flush()
    assert path_of(cache, "k0").stat().st_mode & 0o777 == 0o600
    cache.close()

    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    assert DiskCache(shared, GiB, FP).enabled and shared.stat().st_mode & 0o777 == 0o700

    off = DiskCache(None, GiB, FP)
    assert not off.enabled and off.put("k", *entry(12)) is False and off.get("k") is None
    assert not off.holds("k") and off.entries() == {}
    off.remove("k")
    off.close()
    assert not warnings_of(caplog)


def test_a_folder_of_another_user_is_refused(tmp_path, caplog):
    if os.geteuid() != 0:
        needs("root, to chown a folder to another user")
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o700)
    os.chown(theirs, 65534, 65534)  # nobody
    cache = DiskCache(theirs, GiB, FP)
    assert not cache.enabled and cache.put("k", *entry(12)) is False and cache.get("k") is None
    assert list(theirs.iterdir()) == []
    warned = warnings_of(caplog)
    assert len(warned) == 1 and "owned by another user" in warned[0]


# Eviction


def test_least_recently_used_files_go_first_across_fingerprints(tmp_path):
    folder = tmp_path / "pc"
    old, _, _ = stored(folder, key="x", fp=OTHER)  # a changed checkpoint's entry, the oldest
    size = old.stats()["bytes"]
    old.close()
    cache = DiskCache(folder, int(3.5 * size), FP)
    for key in "abc":
        cache.put(key, *entry(40))
        cache.flush()
    assert not path_of(old, "x").exists()  # the fourth file passed the bound
    assert cache.get("a") is not None  # a is now the most recently used
    cache.put("d", *entry(40))
    cache.flush()
    assert sorted(cache.entries()) == ["a", "c", "d"] and not path_of(cache, "b").exists()
    stats = cache.stats()
    assert stats["evicted"] == 2 and 2.9 * size < stats["bytes"] <= cache.max_bytes
    cache.close()


def test_a_full_queue_drops_rather_than_blocks(tmp_path, monkeypatch):
    entered, release = threading.Event(), threading.Event()
    save = disk_cache.save_prompt_cache

    def slow(*args):  # a writer stuck on a slow disk
        entered.set()
        release.wait(20)
        save(*args)

    monkeypatch.setattr(disk_cache, "save_prompt_cache", slow)
    cache = DiskCache(tmp_path / "pc", GiB, FP, queue_size=1)
    tokens, caches = entry(40)
    assert cache.put("k0", tokens, caches)
    assert entered.wait(10)  # the writer holds k0
    results = []
    puts = threading.Thread(target=lambda: results.extend(cache.put(f"k{i}", tokens, caches) for i in range(1, 6)))
    puts.start()
    puts.join(10)
    alive = puts.is_alive()
    release.set()
    assert not alive, "put blocked on a full queue"
    assert results == [True, False, False, False, False]
    cache.flush()
    stats = cache.stats()
    assert (stats["writes"], stats["write_drops"]) == (2, 4) and sorted(cache.entries()) == ["k0", "k1"]
    cache.close()


# Two servers sharing one folder

SERVER = r"""
import json, random, sys, time
from pathlib import Path
import mlx.core as mx, numpy as np
from mlx_lm.models.cache import KVCache, RotatingKVCache
from distributed.runtime.disk_cache import DiskCache

def entry(i):
    rng = np.random.default_rng(i)
    arrays = [rng.standard_normal((1, 2, 64, 16)).astype(np.float32) for _ in range(4)]
    full, window = KVCache(), RotatingKVCache(16)
    full.update_and_fetch(mx.array(arrays[0]), mx.array(arrays[1]))
    window.update_and_fetch(mx.array(arrays[2]), mx.array(arrays[3]))
    full.keys, full.values = full.keys[..., :64, :], full.values[..., :64, :]
    mx.eval(full.keys, full.values, window.keys, window.values)
    return np.arange(64, dtype=np.int32) + 100 * i, [full, window], arrays

folder, seed = sys.argv[1], int(sys.argv[2])
OPS = 600  # a count, not a time: a loaded machine makes fewer in a given time, never fewer hits for it
cache = DiskCache(folder, 3 * (4 * 8192 + 3000), "c" * 64, queue_size=4)  # room for three of the six keys
entries = [entry(i) for i in range(6)]
rnd = random.Random(seed)
hits = misses = wrong = 0
(Path(folder).parent / f"ready{seed}").touch()  # both start together, then make OPS operations each
while len(list(Path(folder).parent.glob("ready*"))) < 2:
    time.sleep(0.01)
for _ in range(OPS):
    i = rnd.randrange(6)
    tokens, caches, arrays = entries[i]
    op = rnd.random()
    if op < 0.35:
        cache.put(f"key{i}", tokens, caches, {"i": str(i)})
    elif op < 0.45:
        cache.remove(f"key{i}")
    elif op < 0.5:
        cache.flush()
    else:
        got = cache.get(f"key{i}")
        if got is None:
            misses += 1
            continue
        hits += 1
        t, (f, w), meta = got
        same = (np.array_equal(t, tokens) and meta == {"i": str(i)} and f.offset == w.offset == 64
                and all(np.array_equal(np.array(x), a) for x, a in zip((f.keys, f.values, w.keys, w.values), arrays)))
        wrong += not same
cache.close()
print(json.dumps({"hits": hits, "misses": misses, "wrong": wrong, "stats": cache.stats()}))
"""


def test_two_servers_sharing_a_folder_never_see_wrong_data(tmp_path):
    folder = tmp_path / "shared"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    servers = [subprocess.Popen([sys.executable, "-c", SERVER, str(folder), str(seed)], cwd=ROOT,
                                env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for seed in (1, 2)]
    results = []
    try:
        for server in servers:
            out, err = server.communicate(timeout=60)
            assert server.returncode == 0, err
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        for server in servers:
            if server.poll() is None:
                server.kill()
                server.wait()
    assert [r["wrong"] for r in results] == [0, 0]
    assert sum(r["hits"] for r in results) > 20 and sum(r["misses"] for r in results) > 0
    assert sum(r["stats"]["evicted"] for r in results) > 0  # the bound was at work
    assert not [p for p in folder.rglob(".*")]  # no temporary file left behind


# Keys and fingerprints


def test_chain_hashes():
    tokens = np.arange(1000, dtype=np.int32)
    hashes = chain_hashes(tokens, block=256, seed="fp")
    assert len(hashes) == 3 and len(set(hashes)) == 3  # the last 232 tokens make no full block
    assert chain_hashes(tokens[:800], 256, "fp") == hashes  # the same prefix blocks, the same hashes
    assert chain_hashes(tokens.astype(np.int64).tolist(), 256, "fp") == hashes
    assert chain_hashes(tokens[:255], 256, "fp") == []
    changed = tokens.copy()
    changed[300] += 1  # block 1
    other = chain_hashes(changed, 256, "fp")
    assert other[0] == hashes[0] and other[1] != hashes[1] and other[2] != hashes[2]
    assert chain_hashes(tokens, 256, "another")[0] != hashes[0]
    assert chain_hashes(tokens, 128, "fp")[0] != hashes[0]


def test_fingerprint_changes_with_what_made_an_entry(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    weights = model / "model.safetensors"
    weights.write_bytes(b"x" * 100)
    (model / "config.json").write_text("{}")
    config = {"model_type": "afmoe", "quantization": {"bits": 4, "group_size": 64}}
    base = fingerprint(model, config, "bfloat16", (0, 8))
    assert base == fingerprint(model, dict(config), "bfloat16", [0, 8]) and len(base) == 64
    variants = [
        fingerprint(model, config, "bfloat16", (0, 9)),
        fingerprint(model, config, "bfloat16", (0, 8), (0, 2)),
        fingerprint(model, config, "bfloat16", (0, 8), (1, 2)),
        fingerprint(model, config, "float32", (0, 8)),
        fingerprint(model, {**config, "quantization": {"bits": 8, "group_size": 64}}, "bfloat16", (0, 8)),
    ]
    weights.write_bytes(b"x" * 101)  # another size
    variants.append(fingerprint(model, config, "bfloat16", (0, 8)))
    weights.write_bytes(b"x" * 100)
    os.utime(weights, ns=(1, 1))  # another modification time
    variants.append(fingerprint(model, config, "bfloat16", (0, 8)))
    assert len(set(variants + [base])) == len(variants) + 1


def test_defaults(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert default_folder() == tmp_path / "xdg" / "trinity-pipeline" / "prefix-cache"
    monkeypatch.setenv("XDG_CACHE_HOME", "relative")
    assert default_folder() == Path.home() / ".cache" / "trinity-pipeline" / "prefix-cache"
    free = shutil.disk_usage(tmp_path).free
    bound = default_disk_bytes(tmp_path / "not" / "yet")
    assert 0 < bound <= min(free // 4 + 2**20, 64 * GiB)
