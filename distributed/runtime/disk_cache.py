"""A rank's disk tier of prefix-cache entries: its layers' slice of each entry (its tensor
share where tensor parallel is on), kept in files across restarts.

Entries are keyed by a chain hash of token blocks (chain_hashes: vLLM's, SGLang's and
LMCache's scheme), so any block boundary of a stored prompt names one key. Rank 0 decides
from what every rank holds; this module only keeps one rank's files.

On disk: folder/<fingerprint[:16]>/<key>.safetensors, one file per entry, written by
mlx-lm's save_prompt_cache (safetensors: a JSON header, then the arrays; load_prompt_cache
reads it back whole). The header's metadata (mlx-lm keeps ours under "0.") holds the format
version, the fingerprint (fingerprint(): checkpoint, quantization, dtype, layer range,
tensor share), the key, the tokens (int32, zlib, base64), the caller's `meta` (JSON), a
digest of every piece of every array (a piece: PIECE tokens of one row, a head's, of a
cache's keys or values) and a checksum over all of these and the caches' description
(classes, scalars, arrays' dtypes and shapes). A read (EntryFile) checks the header, then
reads only the token ranges it is asked for, and checks each piece it reads: restoring a
prompt's first t tokens reads the full-attention layers' first t and the sliding layers'
last window before t, not the log of every token (three quarters of a long entry). A torn
or flipped file is never read back as an entry.
Subfolders keep fingerprints apart (a restart with another split or checkpoint finds
nothing of the old one); the byte bound is over the whole folder, least recently used
first by mtime (a hit refreshes it), so what no server reads any more ages out.

Writes are off the caller's thread (a bounded queue that drops what it cannot keep up
with: a decode step never waits for a disk) and atomic: a uniquely named temporary file
in the same subfolder, fsync, rename, fsync of the subfolder. Two servers sharing a folder
therefore only ever see whole files, and one deleted by the other is a miss. Any I/O
failure costs this tier only: put/get/holds/remove/entries never raise on one. A failed
write (a full or read-only disk) is dropped, warned about once, and writing pauses for
`retry_seconds` before it is tried again (the disk may have room again by then).
"""

import base64
import copy
import hashlib
import json
import logging
import os
import queue
import re
import secrets
import stat
import sys
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple, TypeVar

import mlx.core as mx
import numpy as np
from mlx.utils import tree_unflatten
from mlx_lm.models.cache import KVCache, RotatingKVCache, save_prompt_cache

log = logging.getLogger(__name__)
T = TypeVar("T")

FORMAT_VERSION = 2  # 2: piece digests, read by token range
SUFFIX = ".safetensors"
TEMP = ".tmp" + SUFFIX  # a temporary file: "." + key + "." + unique + TEMP (mx.save_safetensors wants the suffix)
STALE_TEMP_SECONDS = 3600  # a temporary file this old was left by a writer that died
RETRY_SECONDS = 60.0
MAX_HEADER = 64 * 2**20
PIECE = 1024  # tokens of one row a piece digest covers: a read of a range reads at most two pieces more
DIGEST = 16  # bytes of a piece's digest (sha256's first 16)
FIELDS = ("format", "fingerprint", "key", "tokens", "meta")  # what the checksum covers beside the caches
CACHES = {"KVCache": KVCache, "RotatingKVCache": RotatingKVCache}
COUNTERS = ("writes", "write_drops", "write_errors", "reads", "hits", "misses", "corrupt",
            "fingerprint_mismatches", "evicted")
DTYPE_BYTES = {"BOOL": 1, "U8": 1, "I8": 1, "U16": 2, "I16": 2, "F16": 2, "BF16": 2, "U32": 4, "I32": 4,
               "F32": 4, "U64": 8, "I64": 8, "F64": 8, "C64": 8}
# How a file's arrays are read back: (numpy dtype of the bytes, MLX dtype they are viewed as)
DTYPES = {"BOOL": (np.bool_, mx.bool_), "U8": (np.uint8, mx.uint8), "I8": (np.int8, mx.int8),
          "U16": (np.uint16, mx.uint16), "I16": (np.int16, mx.int16), "F16": (np.float16, mx.float16),
          "BF16": (np.uint16, mx.bfloat16), "U32": (np.uint32, mx.uint32), "I32": (np.int32, mx.int32),
          "F32": (np.float32, mx.float32), "U64": (np.uint64, mx.uint64), "I64": (np.int64, mx.int64),
          "C64": (np.complex64, mx.complex64)}
SAFETENSORS = {mx_dtype: name for name, (_, mx_dtype) in DTYPES.items()}


def default_folder() -> Path:
    base = os.environ.get("XDG_CACHE_HOME", "")
    if not os.path.isabs(base):  # the XDG spec: a relative path is to be ignored
        base = Path.home() / ".cache"
    return Path(base) / "trinity-pipeline" / "prefix-cache"


def default_disk_bytes(folder) -> int:
    """A quarter of the free space of the folder's filesystem, at most 64 GiB. The tier is a
    cache: it must never be what fills the disk its user works on (nor starve the other
    ranks or servers sharing it), so it takes a share of what is free when the server starts.
    64 GiB holds tens of 32k-token prefixes of a rank's layers, and bounds what a forgotten
    folder costs."""
    path = Path(folder)
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        fs = os.statvfs(path)
    except OSError:
        return 0
    return min(fs.f_bavail * fs.f_frsize // 4, 64 * 2**30)


def fingerprint(model_dir: Path, config: dict, dtype: str, layers: Tuple[int, int],
                tensor: Optional[Tuple[int, int]] = None) -> str:
    """What made an entry: an entry is restored only where all of this is the same. Weight
    files count by name, size and modification time (hashing their contents would read the
    whole checkpoint at every start); the config carries the quantization."""
    files = []
    for pattern in ("*.safetensors", "*.json"):
        for path in Path(model_dir).glob(pattern):
            try:
                st = path.stat()  # follows the HF cache's symlinks to the blobs
                files.append([path.name, st.st_size, st.st_mtime_ns])
            except OSError:
                files.append([path.name, -1, -1])
    what = {"format": FORMAT_VERSION, "config": config, "files": sorted(files), "dtype": str(dtype),
            "layers": [int(i) for i in layers], "tensor": [int(i) for i in tensor] if tensor else None}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()


BLOCK = 256  # tokens a chain hash covers (vLLM's and SGLang's block size for prefix caching)


def chain_hashes(tokens, block: int = BLOCK, seed: str = "") -> List[str]:
    """One hash per full block: h_i = H(h_{i-1} || tokens of block i), h_{-1} = seed. Equal
    prefixes give equal hashes; a change in block i changes hashes i and after only."""
    tokens = np.ascontiguousarray(tokens, dtype="<i4")
    h = seed.encode()
    hashes = []
    for start in range(0, len(tokens) - block + 1, block):
        h = hashlib.blake2b(h + tokens[start:start + block].tobytes(), digest_size=16).digest()
        hashes.append(h.hex())
    return hashes


class Corrupt(Exception):
    pass


class Mismatch(Exception):
    pass


@dataclass
class Held:
    name: str  # the file's name in this instance's subfolder
    tokens: np.ndarray
    size: int
    meta: dict  # the caller's, as put


class DiskCache:
    def __init__(self, folder: Optional[Path], max_bytes: int, fingerprint: str, queue_size: int = 2,
                 retry_seconds: float = RETRY_SECONDS):
        self.folder = Path(folder) if folder is not None else None
        self.max_bytes = int(max_bytes)
        self.fingerprint = fingerprint
        self.retry_seconds = retry_seconds
        self.enabled = False
        self.writable = False  # False in a folder it can read but not write: entries are read, none written
        self.sub: Optional[Path] = None
        self._held: Dict[str, Held] = {}
        self._lock = threading.Lock()  # _held and the counters: the writer thread changes them too
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._read_seconds = 0.0
        self._warned = False
        self._paused_until = 0.0
        self._queue: "queue.Queue" = queue.Queue(maxsize=max(1, queue_size))
        self._pending = 0  # puts queued or being written
        self._idle = threading.Condition()
        self._writer: Optional[threading.Thread] = None
        if self.folder is None:
            return
        why = self._open()
        if why:
            log.warning("prefix cache on disk: %s; the disk tier is off, serving goes on from RAM", why)
            return
        self.enabled = True
        if self.writable:
            self._evict()  # learns what the subfolder holds, and keeps to a bound that may have shrunk
            self._writer = threading.Thread(target=self._run, name="prefix-cache-disk", daemon=True)
            self._writer.start()
        else:
            self._reconcile(self._listing())

    def _open(self) -> Optional[str]:
        """Make the folder and this fingerprint's subfolder; why they cannot be used, if so."""
        try:
            self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
            st = self.folder.stat()
        except OSError as e:
            return f"cannot create {self.folder}: {e.strerror or e}"
        if not stat.S_ISDIR(st.st_mode):
            return f"{self.folder} is not a folder"
        if st.st_uid != os.geteuid():  # another user could plant entries: never trust them
            return f"{self.folder} is owned by another user (uid {st.st_uid}, this process runs as {os.geteuid()})"
        if st.st_mode & 0o077:
            try:
                os.chmod(self.folder, 0o700)
            except OSError as e:
                return f"cannot make {self.folder} private (mode {st.st_mode & 0o777:o}): {e.strerror or e}"
            log.info("prefix cache on disk: %s was mode %o, made 0700", self.folder, st.st_mode & 0o777)
        self.sub = self.folder / self.fingerprint[:16]
        try:
            self.sub.mkdir(mode=0o700, exist_ok=True)
        except OSError as e:
            if not self.sub.is_dir():
                return f"cannot create {self.sub}: {e.strerror or e}"
        try:
            if self.sub.stat().st_uid != os.geteuid():
                return f"{self.sub} is owned by another user"
        except OSError as e:
            return f"cannot read {self.sub}: {e.strerror or e}"
        self.writable = os.access(self.sub, os.W_OK | os.X_OK)
        if not self.writable:
            self._warned = True
            log.warning("prefix cache on disk: %s is read-only: its entries are read, none are written; "
                        "serving goes on from RAM", self.sub)
        return None

    # What the caller uses

    def put(self, key: str, tokens: np.ndarray, caches: list, meta: Optional[dict] = None) -> bool:
        """Queue an entry for the writer thread; False where it is dropped (never waits).
        `caches`: plain mlx-lm caches (KVCache, RotatingKVCache), evaluated, each holding
        `tokens` or a prefix of them (a sliding layer's unrotated keys of its first tokens,
        caches.Stored's log, may travel as a KVCache: say which in `meta`). What is queued
        has array objects of its own, so the caller may go on updating its caches; a KVCache
        padded past its offset is copied here (a compact one, caches.compact's, costs nothing).
        A put is dropped before that copy where the queue is full."""
        paused = time.monotonic() < self._paused_until
        if not (self.enabled and self.writable and self._writer) or paused or self._queue.full():
            self._count("write_drops")
            return False
        tokens = np.array(tokens, dtype=np.int32).reshape(-1)
        caches = snapshot(caches, len(tokens))
        meta = {str(k): str(v) for k, v in (meta or {}).items()}
        if sum(c.nbytes for c in caches) > self.max_bytes:
            self._count("write_drops")
            return False
        with self._idle:
            try:
                self._queue.put_nowait((key, tokens, caches, meta))
            except queue.Full:
                self._count("write_drops")
                return False
            self._pending += 1
        return True

    def get(self, key: str) -> Optional[Tuple[np.ndarray, list, dict]]:
        """(tokens, caches, meta) of the entry, every array whole, or None (as read())."""
        return self.read(key, lambda f: (f.tokens, [f.whole(i) for i in range(len(f.classes))], f.meta))

    def read(self, key: str, reader: Callable[["EntryFile"], Optional[T]]) -> Optional[T]:
        """What `reader` makes of the entry's file (EntryFile: it reads what it needs), or None.
        A file of another fingerprint or format (counted as a fingerprint mismatch), or one that
        fails any check (header, sizes, checksum, a piece read: counted as corrupt), is removed;
        a reader that returns None cannot use the entry (a miss; the file stays). The file is
        read through one descriptor: another server replacing or removing it meanwhile changes
        nothing of what is read. Every None is a miss."""
        if not self.enabled:
            return None
        start = time.perf_counter()
        path = self.sub / file_name(key)
        got = None
        try:
            with open(path, "rb") as f:
                got = reader(EntryFile(f, self.fingerprint, key))
        except FileNotFoundError:
            self._forget(key)
        except Mismatch as e:
            self._count("fingerprint_mismatches")
            log.info("prefix cache on disk: %s is not this checkpoint's or split's (%s): removed", path.name, e)
            self._drop(key, path)
        except Exception as e:  # noqa: BLE001  -- nothing in a file may crash a rank
            self._count("corrupt")
            log.warning("prefix cache on disk: %s is damaged (%s): removed", path, e)
            self._drop(key, path)
        if got is not None:
            self._touch(path)
        with self._lock:
            self._counts["reads"] += 1
            self._counts["hits" if got is not None else "misses"] += 1
            self._read_seconds += time.perf_counter() - start
        return got

    def holds(self, key: str) -> bool:
        if not self.enabled:
            return False
        with self._lock:
            held = self._held.get(key)
        if held is None:
            return False
        if not os.path.exists(self.sub / held.name):  # evicted by another server sharing the folder
            self._forget(key)
            return False
        return True

    def entries(self) -> Dict[str, np.ndarray]:
        """key -> tokens of every entry this instance knows it holds (what it found at start,
        wrote, or saw another server of the same fingerprint write)."""
        with self._lock:
            return {key: held.tokens for key, held in self._held.items()}

    def listing(self) -> List[Tuple[np.ndarray, dict]]:
        """(tokens, meta) of every entry entries() names."""
        with self._lock:
            return [(held.tokens, held.meta) for held in self._held.values()]

    def remove(self, key: str) -> None:
        if self.enabled:
            self._drop(key, self.sub / file_name(key))

    def flush(self, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        with self._idle:
            while self._pending and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())

    def close(self) -> None:
        """Write what is queued (waiting at most 30 s), stop the writer, turn the tier off."""
        if self._writer is not None:
            self.flush()
            try:
                self._queue.put_nowait(None)
            except queue.Full:  # the writer is stuck on a disk: it is a daemon thread, leave it
                pass
            self._writer.join(timeout=5)
            self._writer = None
        self.enabled = False

    def stats(self) -> dict:
        with self._lock:
            out = dict(self._counts)
            out["bytes"] = sum(held.size for held in self._held.values())
            out["entries"] = len(self._held)
            out["read_seconds"] = self._read_seconds
        return out

    def _touch(self, path: Path) -> None:
        """A hit is the most recently used: the eviction goes by mtime."""
        now = time.time_ns()
        try:
            os.utime(path, ns=(now, now))
        except OSError:
            pass

    # Writing (the writer thread)

    def _run(self) -> None:
        background_priority()
        while True:
            job = self._queue.get()
            if job is None:
                return
            try:
                self._write(*job)
            except Exception:  # noqa: BLE001  -- a bug here must not end the writer
                log.exception("prefix cache on disk: writing an entry failed")
                self._count("write_errors")
            finally:
                with self._idle:
                    self._pending -= 1
                    self._idle.notify_all()

    def _write(self, key: str, tokens: np.ndarray, caches: list, meta: dict) -> None:
        if time.monotonic() < self._paused_until:  # queued before a failure
            self._count("write_drops")
            return
        name = file_name(key)
        temp = self.sub / f".{name[:-len(SUFFIX)]}.{os.getpid()}-{secrets.token_hex(6)}{TEMP}"
        fields = {"format": str(FORMAT_VERSION), "fingerprint": self.fingerprint, "key": key,
                  "tokens": encode_tokens(tokens), "meta": json.dumps(meta, sort_keys=True)}
        fields["pieces"] = piece_digests(caches).hex()
        fields["checksum"] = checksum(fields, describe(caches))
        try:
            if not self.sub.is_dir():  # the folder was removed while the server ran: make it again
                self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
                self.sub.mkdir(mode=0o700, exist_ok=True)
            save_prompt_cache(str(temp), caches, fields)
            with open(temp, "rb") as f:  # all of it is there (MLX reports a short write; this is cheap)
                read_header(f, os.fstat(f.fileno()).st_size)
                os.fchmod(f.fileno(), 0o600)
                os.fsync(f.fileno())
            now = time.time_ns()
            os.utime(temp, ns=(now, now))
            os.replace(temp, self.sub / name)
            size = (self.sub / name).stat().st_size
            fsync_folder(self.sub)
        except Exception as e:  # noqa: BLE001  -- MLX reports I/O errors as RuntimeError
            unlink(temp)
            self._failed(e)
            return
        with self._lock:
            self._held[key] = Held(name, tokens, size, meta)
            self._counts["writes"] += 1
        self._evict()

    def _failed(self, error: Exception) -> None:
        self._count("write_errors")
        self._paused_until = time.monotonic() + self.retry_seconds
        if self._warned:
            log.debug("prefix cache on disk: cannot write in %s: %s", self.sub, error)
            return
        self._warned = True
        log.warning("prefix cache on disk: cannot write in %s (%s); this entry is dropped and writes pause "
                    "for %g s; serving goes on from RAM", self.sub, error, self.retry_seconds)

    def _listing(self) -> List[Tuple[int, int, Path]]:
        """(mtime_ns, bytes, path) of every entry file in the folder, all fingerprints'.
        Removes the temporary files of writers that died."""
        files = []
        try:
            subs = [d for d in os.scandir(self.folder) if d.is_dir(follow_symlinks=False)]
        except OSError:
            return files
        now = time.time_ns()
        for sub in subs:
            try:
                found = list(os.scandir(sub.path))
            except OSError:
                continue
            for entry in found:
                if not entry.name.endswith(SUFFIX):
                    continue
                try:
                    st = entry.stat(follow_symlinks=False)
                except OSError:  # removed since the listing
                    continue
                if entry.name.startswith("."):
                    if entry.name.endswith(TEMP) and now - st.st_mtime_ns > STALE_TEMP_SECONDS * 1e9:
                        unlink(Path(entry.path))
                    continue
                files.append((st.st_mtime_ns, st.st_size, Path(entry.path)))
        return files

    def _reconcile(self, files: List[Tuple[int, int, Path]]) -> None:
        """Know what this subfolder holds: its files' headers only, no tensor data. A file
        another server of this fingerprint wrote is learnt; one gone is forgotten."""
        here = {path.name: (size, path) for _, size, path in files if path.parent == self.sub}
        with self._lock:
            known = {held.name: key for key, held in self._held.items()}
        for name in set(known) - set(here):
            self._forget(known[name])
        for name in set(here) - set(known):
            size, path = here[name]
            try:
                with open(path, "rb") as f:
                    fields = read_header(f, os.fstat(f.fileno()).st_size)
                fields = check_fields(fields, self.fingerprint, None)
                if file_name(fields["key"]) != name:
                    raise Corrupt(f"its key {fields['key']!r} is not its name's")
                tokens = decode_tokens(fields["tokens"])
                meta = json.loads(fields["meta"])
            except FileNotFoundError:
                continue
            except Mismatch as e:
                self._count("fingerprint_mismatches")
                log.info("prefix cache on disk: %s is not this checkpoint's or split's (%s): removed", path, e)
                self._unlink_if_writable(path)
                continue
            except Exception as e:  # noqa: BLE001
                self._count("corrupt")
                log.warning("prefix cache on disk: %s is damaged (%s): removed", path, e)
                self._unlink_if_writable(path)
                continue
            with self._lock:
                self._held[fields["key"]] = Held(name, tokens, size, meta)

    def _evict(self) -> None:
        """Least recently used files first, of every fingerprint, while the folder holds more
        than max_bytes: a changed checkpoint's entries age out."""
        files = self._listing()
        self._reconcile(files)
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            total -= size
            if unlink(path):
                self._count("evicted")
            if path.parent == self.sub:
                self._forget_name(path.name)

    # Bookkeeping

    def _count(self, what: str) -> None:
        with self._lock:
            self._counts[what] += 1

    def _forget(self, key: str) -> None:
        with self._lock:
            self._held.pop(key, None)

    def _forget_name(self, name: str) -> None:
        with self._lock:
            for key, held in list(self._held.items()):
                if held.name == name:
                    del self._held[key]

    def _drop(self, key: str, path: Path) -> None:
        self._forget(key)
        self._unlink_if_writable(path)

    def _unlink_if_writable(self, path: Path) -> None:
        if self.writable:
            unlink(path)


class EntryFile:
    """An entry's file, open: its header checked (parse_header; format, fingerprint and key:
    check_fields; the checksum over the caches' description and every piece's digest). Then
    whole() and read() give a cache's arrays, or any token range of its keys and values,
    reading and checking only the pieces they span."""

    def __init__(self, f, fingerprint: str, key: Optional[str]):
        self.fd = f.fileno()
        self.tensors, metadata, self.data = parse_header(f, os.fstat(self.fd).st_size)
        self.fields = check_fields({k[2:]: v for k, v in metadata.items() if k.startswith("0.")}, fingerprint, key)
        self.tokens = decode_tokens(self.fields["tokens"])
        self.meta = json.loads(self.fields["meta"])
        _, self.classes, scalars = tree_unflatten(list(metadata.items()))  # save_prompt_cache's layout
        if not isinstance(self.classes, list) or any(c not in CACHES for c in self.classes):
            raise Corrupt(f"caches {self.classes!r}")
        kinds = dict(scalars[1:])  # tensor name -> "scalar" / "string" / "none"
        self.states = []  # per cache: its state, arrays by tensor name, scalars by value
        for i in range(len(self.classes)):
            names = sorted((n for n in self.tensors if n.split(".")[0] == str(i)), key=lambda n: int(n.split(".")[1]))
            self.states.append([self._scalar(n, kinds[n]) if n in kinds else n for n in names])
        if len(self.tensors) != sum(map(len, self.states)):
            raise Corrupt("tensors of no cache")
        self.digests, at = {}, 0
        stored = bytes.fromhex(self.fields.get("pieces", ""))
        for state in self.states:
            for name in state:
                if isinstance(name, str) and name in self.tensors and name not in kinds:
                    shape = self.tensors[name][1]
                    if len(shape) < 2:
                        raise Corrupt(f"tensor {name} of shape {shape}")
                    n = pieces(int(np.prod(shape[:-2], dtype=np.int64)), shape[-2]) * DIGEST
                    self.digests[name], at = stored[at:at + n], at + n
        if at != len(stored):
            raise Corrupt(f"{len(stored)} bytes of piece digests for {at}")
        described = [[c, [[self.tensors[x][0], self.tensors[x][1]] if x in self.digests else repr(x) for x in state]]
                     for c, state in zip(self.classes, self.states)]
        if checksum(self.fields, described) != self.fields["checksum"]:
            raise Corrupt("checksum mismatch")

    def scalars(self, i: int) -> list:
        """Cache i's state with its arrays left out (None): offset, and a RotatingKVCache's keep,
        max_size and _idx."""
        return [None if x in self.digests else x for x in self.states[i]]

    def length(self, i: int) -> int:
        """The positions cache i's arrays hold."""
        return self.tensors[self.states[i][0]][1][-2]

    def whole(self, i: int):
        """Cache i, every array whole (an mlx-lm cache)."""
        names = [x for x in self.states[i] if x in self.digests]
        arrays = iter(self._arrays([(x, 0, self.tensors[x][1][-2]) for x in names]))
        cache = CACHES[self.classes[i]].from_state(tuple(next(arrays) if x in self.digests else x
                                                         for x in self.states[i]))
        check_cache(cache, len(self.tokens))
        return cache

    def read(self, wanted: List[Tuple[int, int, int]]) -> List[Tuple[mx.array, mx.array]]:
        """For each (i, start, end): cache i's keys and values of positions [start, end) (axis
        -2), evaluated. All are read at once, on the hashing threads."""
        ranges = []
        for i, start, end in wanted:
            keys, values = self.states[i][:2]
            if not (keys in self.digests and values in self.digests and 0 <= start < end <= self.length(i)):
                raise Corrupt(f"cache {i} holds no positions {start}-{end}")
            ranges += [(keys, start, end), (values, start, end)]
        arrays = self._arrays(ranges)
        return list(zip(arrays[::2], arrays[1::2]))

    def _scalar(self, name: str, kind: str):
        dtype, shape, begin, end = self.tensors[name]
        value = np.frombuffer(os.pread(self.fd, end - begin, self.data + begin), dtype=DTYPES[dtype][0])
        if kind == "scalar" and value.size == 1:
            return value.item()
        if kind == "none":
            return None
        raise Corrupt(f"a {kind} of shape {shape}")

    def _arrays(self, ranges: List[Tuple[str, int, int]]) -> List[mx.array]:
        """Positions [start, end) of each (array, start, end), read a row at a time on the
        hashing threads (preadv and hashlib let go of the GIL: a restore is waited for, and a
        disk serves several reads at once); the pieces they span are read whole and checked."""
        outs, rows = [], []
        for name, start, end in ranges:
            dtype, shape, _, _ = self.tensors[name]
            out = np.empty((int(np.prod(shape[:-2], dtype=np.int64)), (end - start) * shape[-1] * DTYPE_BYTES[dtype]),
                           dtype=np.uint8)
            outs.append(out)
            rows += [(name, start, end, r, out[r]) for r in range(out.shape[0])]
        list(hashers().map(lambda row: self._row(*row), rows))
        arrays = []
        for (name, start, end), out in zip(ranges, outs):
            dtype, shape, _, _ = self.tensors[name]
            array = mx.array(out.view(DTYPES[dtype][0]).reshape(*shape[:-2], end - start, shape[-1]))
            arrays.append(array if DTYPES[dtype][1] == array.dtype else array.view(DTYPES[dtype][1]))
        mx.eval(arrays)
        return arrays

    def _row(self, name: str, start: int, end: int, r: int, out: np.ndarray) -> None:
        """Row r's positions [start, end) of an array into `out`, its pieces checked."""
        dtype, shape, begin, _ = self.tensors[name]
        length, width = shape[-2], shape[-1] * DTYPE_BYTES[dtype]  # width: the bytes of a row's position
        first, after = start // PIECE, -(-end // PIECE)
        lo, hi = first * PIECE, min(length, after * PIECE)
        at = self.data + begin + r * length * width
        head = os.pread(self.fd, (start - lo) * width, at + lo * width)
        got = os.preadv(self.fd, [out], at + start * width)
        tail = os.pread(self.fd, (hi - end) * width, at + end * width)
        if len(head) != (start - lo) * width or got != out.size or len(tail) != (hi - end) * width:
            raise Corrupt(f"{name}: a short read")
        data, per_row = Spans([head, out, tail]), -(-length // PIECE)
        for p in range(first, after):
            a, b = (p * PIECE - lo) * width, (min(length, (p + 1) * PIECE) - lo) * width
            at = (r * per_row + p) * DIGEST
            if data.sha256(a, b)[:DIGEST] != self.digests[name][at:at + DIGEST]:
                raise Corrupt(f"{name}: piece {p} of row {r} does not match its digest")


class Spans:
    """Byte buffers read one after another, hashed across their seams."""

    def __init__(self, parts: list):
        self.parts = [memoryview(p).cast("B") for p in parts]

    def sha256(self, a: int, b: int) -> bytes:
        h, at = hashlib.sha256(), 0
        for part in self.parts:
            lo, hi = max(a, at), min(b, at + len(part))
            if lo < hi:
                h.update(part[lo - at:hi - at])
            at += len(part)
        return h.digest()


# The file

def file_name(key: str) -> str:
    """The key itself where it is a plain name (chain hashes are hex), else its hash: a key
    never names a path outside the subfolder."""
    if re.fullmatch(r"[0-9A-Za-z_-]{1,128}", key):
        return key + SUFFIX
    return hashlib.blake2b(key.encode(), digest_size=16).hexdigest() + SUFFIX


def encode_tokens(tokens: np.ndarray) -> str:
    return base64.b64encode(zlib.compress(tokens.astype("<i4").tobytes(), 1)).decode("ascii")


def decode_tokens(text: str) -> np.ndarray:
    return np.frombuffer(zlib.decompress(base64.b64decode(text, validate=True)), dtype="<i4").astype(np.int32)


def parse_header(f, size: int) -> Tuple[Dict[str, tuple], Dict[str, str], int]:
    """A safetensors file's tensors (name -> (dtype, shape, begin, end), offsets into the data),
    its metadata and where its data starts, after checking that the header parses and that the
    tensors' dtypes, shapes and offsets tile the rest of the file exactly (a truncated or torn
    file fails here, before anything of its data is read)."""
    raw = f.read(8)
    if len(raw) < 8:
        raise Corrupt(f"{size} bytes: no header")
    n = int.from_bytes(raw, "little")
    if n > min(size - 8, MAX_HEADER):
        raise Corrupt(f"a header of {n} bytes in a file of {size}")
    header = json.loads(f.read(n))
    metadata = header.pop("__metadata__", None)
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise Corrupt("no metadata")
    tensors, spans = {}, []
    for name, t in header.items():
        begin, end = t["data_offsets"]
        shape = [int(i) for i in t["shape"]]
        count = int(np.prod(shape, dtype=np.int64))
        if min(shape, default=0) < 0 or t["dtype"] not in DTYPES or count * DTYPE_BYTES[t["dtype"]] != end - begin:
            raise Corrupt(f"tensor {name}: shape {t['shape']} of {t['dtype']} in {end - begin} bytes")
        tensors[name] = (t["dtype"], shape, begin, end)
        spans.append((begin, end))
    at = 0
    for begin, end in sorted(spans):
        if begin != at:
            raise Corrupt("tensors do not tile the data")
        at = end
    if 8 + n + at != size:
        raise Corrupt(f"{size} bytes where the header announces {8 + n + at}")
    return tensors, metadata, 8 + n


def read_header(f, size: int) -> Dict[str, str]:
    """Our metadata fields of an entry's file (parse_header's checks passed)."""
    _, metadata, _ = parse_header(f, size)
    return {k[2:]: v for k, v in metadata.items() if k.startswith("0.")}  # save_prompt_cache's metadata


def check_fields(fields, fingerprint: str, key: Optional[str]) -> Dict[str, str]:
    if not isinstance(fields, dict) or any(not isinstance(fields.get(f), str) for f in FIELDS + ("checksum",)):
        raise Corrupt("metadata fields missing")
    if fields["format"] != str(FORMAT_VERSION):
        raise Mismatch(f"format {fields['format']}, not {FORMAT_VERSION}")
    if fields["fingerprint"] != fingerprint:
        raise Mismatch(f"fingerprint {fields['fingerprint'][:16]}")
    if key is not None and fields["key"] != key:
        raise Corrupt(f"it holds key {fields['key']!r}")
    return fields


def check_cache(c, tokens: int) -> None:
    """A cache read whole is one mlx-lm could have left: shapes and offsets agree."""
    k, v = c.keys, c.values
    if k.ndim != 4 or v.ndim != 4 or k.shape[:3] != v.shape[:3]:
        raise Corrupt(f"keys {k.shape}, values {v.shape}")
    if not 0 < c.offset <= tokens:
        raise Corrupt(f"a cache of {c.offset} tokens in an entry of {tokens}")
    if isinstance(c, KVCache) and k.shape[2] != c.offset:
        raise Corrupt(f"a KVCache holds {k.shape[2]} positions of {c.offset}")
    if isinstance(c, RotatingKVCache) and not (0 <= c._idx <= k.shape[2] <= max(c.offset, c.max_size)):
        raise Corrupt(f"a RotatingKVCache of {k.shape[2]} positions at {c._idx}, {c.offset} tokens")


def snapshot(caches: list, tokens: int) -> list:
    """The caches in array objects of their own, contiguous: an in-place update of the
    caller's caches cannot reach what is queued, and the writer thread only copies bytes
    (no MLX computation off the caller's thread). A KVCache keeps its `offset` positions."""
    out = []
    for cache in caches:
        if type(cache) not in CACHES.values():
            raise TypeError(f"the disk tier stores KVCache and RotatingKVCache, not {type(cache).__name__}")
        if cache.keys is None or not 0 < cache.offset <= tokens:
            raise ValueError(f"a cache of {cache.offset} tokens in an entry of {tokens}")
        held = cache.offset if isinstance(cache, KVCache) else cache.keys.shape[2]
        c = copy.copy(cache)
        c.keys, c.values = cache.keys[..., :held, :], cache.values[..., :held, :]  # views: O(1)
        c.offset = int(cache.offset)  # save_prompt_cache takes Python scalars only
        if isinstance(c, RotatingKVCache):
            c.keep, c.max_size, c._idx = int(c.keep), int(c.max_size), int(c._idx)
        out.append(c)
    mx.eval([(c.keys, c.values) for c in out])
    for c in out:
        if not memoryview(c.keys).c_contiguous:  # a padded KVCache: copy its positions
            c.keys, c.values = mx.array(c.keys), mx.array(c.values)
    mx.eval([(c.keys, c.values) for c in out])
    return out


_hashers: Optional[ThreadPoolExecutor] = None
_hashers_lock = threading.Lock()


def describe(caches: list) -> list:
    """What the checksum covers of the caches beside their bytes: each one's class and state,
    arrays by dtype (safetensors' name) and shape, scalars by value."""
    out = []
    for c in caches:
        state = [[SAFETENSORS[item.dtype], list(item.shape)] if isinstance(item, mx.array) else repr(item)
                 for item in c.state]
        out.append([type(c).__name__, state])
    return out


def checksum(fields: Dict[str, str], described: list) -> str:
    """sha256 over the fields, the caches' description and every piece's digest (the pieces'
    bytes are covered by their digests: piece_digests)."""
    text = json.dumps([[fields[f] for f in FIELDS], described]).encode()
    return hashlib.sha256(text + bytes.fromhex(fields["pieces"])).hexdigest()


def pieces(rows: int, length: int) -> int:
    """Digests of an array of `rows` rows of `length` tokens: a row's PIECE tokens each."""
    return rows * -(-length // PIECE)


def piece_digests(caches: list) -> bytes:
    """The digest of every piece of every array of the caches' states, in order: by cache,
    state item, row (every axis but the last two), then PIECE tokens (axis -2) at a time.
    sha256 since CPUs hash it in hardware (x86 SHA extensions, ARMv8's crypto ones): 1.7 GB/s
    a core here, blake2b 0.9. The writer hashes on its own thread only, leaving the other
    cores to the steps."""
    out = []
    for c in caches:
        for item in c.state:
            if isinstance(item, mx.array):
                *_, length, _ = item.shape
                data = np.frombuffer(memoryview(item).cast("B"), dtype=np.uint8)
                width = data.size // max(1, int(np.prod(item.shape[:-1])))  # bytes a token of a row takes
                rows = data.reshape(-1, length * width) if data.size else data.reshape(0, 0)
                for row in rows:
                    out += [sha256(row[at:at + PIECE * width])[:DIGEST] for at in range(0, length * width, PIECE * width)]
    return b"".join(out)


def sha256(data) -> bytes:
    return hashlib.sha256(data).digest()


def hashers() -> ThreadPoolExecutor:
    global _hashers
    with _hashers_lock:
        if _hashers is None:
            _hashers = ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1), thread_name_prefix="prefix-hash")
        return _hashers


def background_priority() -> None:
    """The calling thread yields the CPU to the rank's own (Linux: a thread's nice value is its
    own): where every core runs a rank, a write then waits for idle time, not a decode step.
    Elsewhere (macOS) setpriority takes a process, never a thread: left as it is."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
    except OSError:
        pass


# Files

def unlink(path: Path) -> bool:
    try:
        os.unlink(path)
        return True
    except OSError:
        return False


def fsync_folder(path: Path) -> None:
    """The rename itself reaches the disk (on Linux; macOS's fsync does not flush the drive's
    cache, F_FULLFSYNC would: a torn file after a power cut fails its checksum instead)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
