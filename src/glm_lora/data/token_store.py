"""Tokenise once, memory-map forever: a tokenised dataset as flat `.npy` arrays on disk.

Layout of a store directory (every array 1-D, little-endian, opened with `mmap_mode="r"` and
`allow_pickle=False`, so opening costs nothing and nothing is unpickled):

    tokens.npy   int32  all examples' input ids, concatenated
    labels.npy   int32  same length; -100 = no loss on that position
    offsets.npy  int64  n_examples + 1; example i is tokens[offsets[i]:offsets[i+1]]
    meta.json    n_examples, n_tokens, key, group_size, plus the caller's metadata (written last)

`group_size` is 1 for LM/SFT and 2 for DPO, where examples 2i / 2i+1 are the chosen / rejected
halves of pair i: a sampler runs over `store.n_groups` units and maps unit g to examples
g*group_size ... g*group_size + group_size - 1.

`cached_token_store` keys a store by everything that decides its content (tokenizer, data
files, settings, code version) so a re-run opens the existing arrays instead of tokenising.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import struct
from pathlib import Path
from typing import Callable, Iterable, Iterator, Sequence

import numpy as np

from glm_lora.artifacts.manifest import sha256_json, staging_dir

log = logging.getLogger("glm_lora.data")

IGNORE = -100          # the label of a position that carries no loss (the one definition)
FORMAT = "glm-lora-token-store/1"
TOKENS, LABELS, OFFSETS, META = "tokens.npy", "labels.npy", "offsets.npy", "meta.json"
_ARRAYS = {TOKENS: np.dtype("<i4"), LABELS: np.dtype("<i4"), OFFSETS: np.dtype("<i8")}
_RESERVED = ("format", "n_examples", "n_tokens", "key", "group_size")
_NPY_HEADER = 128          # bytes reserved for the .npy header (magic + length + dict), a multiple of 64
_I32 = np.iinfo(np.int32)

Example = tuple[Sequence[int], Sequence[int]]   # (input_ids, labels), equal lengths


class TokenStoreError(ValueError):
    """A store directory is missing, incomplete or does not match its meta.json."""


class TokenStore:
    """Read-only view of a store directory; arrays are memory-maps, examples are views into them."""

    def __init__(self, path: Path, tokens: np.ndarray, labels: np.ndarray, offsets: np.ndarray, meta: dict):
        self.path, self.tokens, self.labels, self.offsets, self.meta = path, tokens, labels, offsets, meta
        self._lengths: np.ndarray | None = None

    @classmethod
    def open(cls, path: Path) -> "TokenStore":
        """Open and check sizes (not content hashes: a multi-GB re-hash per run defeats the cache)."""
        path = Path(path)
        try:
            meta = json.loads((path / META).read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError) as e:
            raise TokenStoreError(f"{path}: no readable {META} (store missing or its build did not finish): {e}")
        if meta.get("format") != FORMAT:
            raise TokenStoreError(f"{path}/{META}: format {meta.get('format')!r}, expected {FORMAT!r}")
        try:
            n_ex, n_tok = int(meta["n_examples"]), int(meta["n_tokens"])
        except (KeyError, TypeError, ValueError) as e:
            raise TokenStoreError(f"{path}/{META}: no valid n_examples/n_tokens: {e!r}")
        arrays = {}
        for name, dtype in _ARRAYS.items():
            file = path / name
            try:
                arr = np.load(file, mmap_mode="r", allow_pickle=False)
            except (OSError, ValueError) as e:   # a truncated file fails here ("mmap length is greater ...")
                raise TokenStoreError(f"{file}: cannot be memory-mapped: {e}")
            want = (n_ex + 1,) if name == OFFSETS else (n_tok,)
            if arr.dtype != dtype or arr.shape != want:
                raise TokenStoreError(f"{file}: {arr.dtype}{arr.shape}, meta.json says {dtype}{want}")
            if arr.offset + arr.nbytes != file.stat().st_size:
                raise TokenStoreError(f"{file}: {file.stat().st_size} bytes, expected {arr.offset + arr.nbytes}")
            arrays[name] = arr
        offsets = arrays[OFFSETS]
        group_size = meta.get("group_size")
        if not isinstance(group_size, int) or group_size < 1 or n_ex % group_size:
            raise TokenStoreError(f"{path}/{META}: group_size {group_size!r} does not divide {n_ex} examples")
        # 8 bytes per example: cheap next to tokenising, and catches a corrupted offsets file.
        if offsets[0] != 0 or offsets[-1] != n_tok or (n_ex and np.any(np.diff(offsets) < 0)):
            raise TokenStoreError(f"{path / OFFSETS}: not a non-decreasing 0 .. {n_tok} sequence")
        return cls(path, arrays[TOKENS], arrays[LABELS], offsets, meta)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def group_size(self) -> int:
        return int(self.meta["group_size"])

    @property
    def n_groups(self) -> int:
        """Sampling units: examples for LM/SFT, (chosen, rejected) pairs for DPO."""
        return len(self) // self.group_size

    def lengths(self) -> np.ndarray:
        """Tokens per example (int64), computed once from the offsets."""
        if self._lengths is None:
            self._lengths = np.asarray(np.diff(self.offsets))
        return self._lengths

    def group_labels(self) -> np.ndarray | None:
        """A label per group when the store has them (KTO: 1 = the pair's answer is desirable), else None."""
        labels = self.meta.get("group_labels")
        return None if labels is None else np.asarray(labels, dtype=np.int64)

    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(input_ids, labels) of example i: int32 views into the memory-maps (no copy)."""
        if not 0 <= i < len(self):
            raise IndexError(f"example {i} out of range for a store of {len(self)}")
        a, b = int(self.offsets[i]), int(self.offsets[i + 1])
        return self.tokens[a:b], self.labels[a:b]

    def __reduce__(self):
        # Pickling (e.g. into DataLoader workers) sends the path and re-opens, never the arrays.
        return (type(self).open, (self.path,))

    def __repr__(self) -> str:
        return f"TokenStore({str(self.path)!r}, examples={len(self)}, tokens={len(self.tokens)})"


def cached_token_store(cache_root: Path, key_parts: dict, build: Callable[[], Iterable[Example]], *,
                       group_size: int = 1, meta_fn: Callable[[], dict] | None = None,
                       chunk_tokens: int = 1 << 22) -> TokenStore:
    """Open the store for `key_parts` under `cache_root`, building it first if absent or broken.

    key = sha256 of key_parts; the store lives in cache_root/<key[:16]>. `build()` is only called
    on a miss; `meta_fn()` is called after build()'s examples are exhausted, so it can report
    counts gathered while streaming (e.g. the clean report). Concurrent builders (processes or
    threads, e.g. parallel stages) serialise on a lock file: the first builds, the rest open its result.
    """
    key = sha256_json(key_parts)
    final = Path(cache_root).resolve() / key[:16]
    store, why = _open_matching(final, key, group_size)
    if store is not None:
        return store
    with _build_lock(final) as locked:
        store, why = _open_matching(final, key, group_size)   # someone built it while we waited
        if store is not None:
            return store
        if locked:
            _remove_stale_temps(final)
        if final.exists():
            log.warning("rebuilding token store %s: %s", final, why)
        log.info("tokenising into %s", final)
        with staging_dir(final, _is_store) as tmp:
            (tmp / "key_parts.json").write_text(json.dumps(key_parts, indent=2, sort_keys=True, default=str))
            _write(build(), tmp, group_size=group_size, meta_fn=meta_fn or dict,
                   chunk_tokens=chunk_tokens, key=key)
    return TokenStore.open(final)


# --- writing ---------------------------------------------------------------------------------------

class _NpyAppender:
    """Append to a 1-D .npy file through a fixed-size buffer; the header is filled in on close.

    The header is given a fixed 128 bytes up front (numpy itself pads headers so they can be
    rewritten in place when an array grows), so the data is written once, never re-copied.
    """

    def __init__(self, path: Path, dtype: np.dtype, chunk: int):
        self.path, self.dtype = path, dtype
        self.f = open(path, "wb")
        self.f.write(b"\0" * _NPY_HEADER)
        self.buf = np.empty(max(chunk, 1), dtype=dtype)
        self.fill = 0      # items in buf
        self.count = 0     # items written or buffered

    def append(self, a: np.ndarray) -> None:
        n = len(a)
        if self.fill + n > len(self.buf):
            self._flush()
        if n > len(self.buf):
            self.f.write(a.astype(self.dtype, copy=False).tobytes())
        else:
            self.buf[self.fill:self.fill + n] = a
            self.fill += n
        self.count += n

    def _flush(self) -> None:
        self.f.write(self.buf[:self.fill].tobytes())
        self.fill = 0

    def close(self) -> None:
        self._flush()
        d = {"descr": np.lib.format.dtype_to_descr(self.dtype), "fortran_order": False, "shape": (self.count,)}
        header = repr(d).encode("latin1")
        room = _NPY_HEADER - 10 - 1          # magic (6) + version (2) + header length (2), trailing "\n"
        assert len(header) <= room, header
        self.f.seek(0)
        self.f.write(b"\x93NUMPY\x01\x00" + struct.pack("<H", room + 1) + header.ljust(room) + b"\n")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()


def _as_ids(x, what: str, i: int) -> np.ndarray:
    a = np.asarray(x)
    if a.ndim != 1 or (a.size and a.dtype.kind not in "iu"):
        raise ValueError(f"example {i}: {what} must be a 1-D sequence of ints, got {a.dtype}{a.shape}")
    if a.size and (a.min() < _I32.min or a.max() > _I32.max):
        raise ValueError(f"example {i}: {what} has values outside int32")
    return a


def _write(examples: Iterable[Example], out: Path, *, group_size: int, meta_fn: Callable[[], dict],
           chunk_tokens: int, key: str) -> None:
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    tokens = _NpyAppender(out / TOKENS, _ARRAYS[TOKENS], chunk_tokens)
    labels = _NpyAppender(out / LABELS, _ARRAYS[LABELS], chunk_tokens)
    offsets = _NpyAppender(out / OFFSETS, _ARRAYS[OFFSETS], max(chunk_tokens // 64, 1024))
    files = (tokens, labels, offsets)
    try:
        offsets.append(np.zeros(1, dtype=np.int64))
        n = 0
        for n, (ids, lab) in enumerate(examples, start=1):
            ids, lab = _as_ids(ids, "input_ids", n - 1), _as_ids(lab, "labels", n - 1)
            if len(ids) != len(lab):
                raise ValueError(f"example {n - 1}: {len(ids)} input_ids but {len(lab)} labels (must be equal; "
                                 f"use {IGNORE} for positions without loss)")
            tokens.append(ids)
            labels.append(lab)
            offsets.append(np.array([tokens.count], dtype=np.int64))
    finally:
        for f in files:
            if not f.f.closed:
                f.close()
    if n % group_size:
        raise ValueError(f"{n} examples is not a multiple of group_size {group_size} (DPO needs whole pairs)")
    user = dict(meta_fn() or {})
    clash = sorted(set(user) & set(_RESERVED))
    if clash:
        raise ValueError(f"meta keys {clash} are reserved by the token store")
    record = {"format": FORMAT, "n_examples": n, "n_tokens": tokens.count, "key": key, "group_size": group_size,
              **user}
    # meta.json last: its presence marks a complete store.
    with open(out / META, "w", encoding="utf-8") as f:
        json.dump(record, f, indent=2, sort_keys=True, default=str)
        f.flush()
        os.fsync(f.fileno())


# --- cache helpers ---------------------------------------------------------------------------------

def _is_store(path: Path) -> bool:
    """Only a token store, whole or broken (one of its own files is there), is replaced by a rebuild."""
    return path.is_dir() and not path.is_symlink() and any(
        (path / f).is_file() for f in (META, TOKENS, OFFSETS, "key_parts.json"))


_is_store.what = "token store (meta.json, tokens.npy, offsets.npy or key_parts.json)"


def _open_matching(path: Path, key: str, group_size: int) -> tuple[TokenStore | None, str]:
    if not path.exists():
        return None, "absent"
    try:
        store = TokenStore.open(path)
    except (ValueError, KeyError, TypeError, OSError) as e:
        return None, str(e)
    if store.meta.get("key") != key:      # a 64-bit prefix collision, or a hand-edited dir
        return None, f"key {store.meta.get('key')} != {key}"
    if store.group_size != group_size:
        return None, f"group_size {store.group_size} != {group_size}"
    return store, ""


@contextlib.contextmanager
def _build_lock(final: Path) -> Iterator[bool]:
    """Exclusive flock on cache_root/.<name>.lock; yields whether it is held.

    Without a lock (no fcntl, or a filesystem that refuses flock) builders still cannot corrupt
    each other — each writes its own temp dir and renames it in whole — they just all tokenise.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    try:
        import fcntl
    except ImportError:
        yield False
        return
    with open(final.parent / f".{final.name}.lock", "a+b") as f:
        try:
            fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        except OSError as e:
            log.warning("no lock on %s (%s); concurrent builders will each tokenise", f.name, e)
            yield False
            return
        try:
            yield True
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def _remove_stale_temps(final: Path) -> None:
    """Drop the temp (and replaced-store) dirs of builders that died: we hold the lock, so no live one owns them."""
    for pattern in (f".{final.name}.tmp-*", f".{final.name}.old-*"):
        for p in final.parent.glob(pattern):
            shutil.rmtree(p, ignore_errors=True)
