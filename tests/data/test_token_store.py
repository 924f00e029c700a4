"""Token store: streaming write, memory-mapped read, and the build-once cache (the one way to build a store)."""
from __future__ import annotations

import json
import os
import pickle
import threading

import numpy as np
import pytest

from glm_lora.data.token_store import IGNORE, TokenStore, TokenStoreError, cached_token_store

# Ragged on purpose: an empty example, one with no loss at all, one longer than the write chunk.
EXAMPLES = [
    ([5, 6, 7], [IGNORE, 6, 7]),
    ([], []),
    ([1], [IGNORE]),
    ([9, 8, 7, 6], [IGNORE] * 4),
    (list(range(100, 137)), list(range(100, 137))),
    ([2, 3], [2, 3]),
]


KEY = {"tokenizer": "abc", "data": ["f00"], "seq_len": 64, "code": 1}


def write(root, examples, **kw) -> TokenStore:
    """A store of `examples` (a list or a one-shot iterator) in the cache at `root`."""
    return cached_token_store(root, KEY, lambda: examples, **kw)


def leftovers(root, store_name: str) -> list[str]:
    """What is in the cache dir besides the store and its lock file (temp dirs of a write, say)."""
    return sorted(set(p.name for p in root.iterdir()) - {store_name, f".{store_name}.lock"})


def _check(store: TokenStore, examples) -> None:
    assert len(store) == len(examples)
    assert store.lengths().tolist() == [len(ids) for ids, _ in examples]
    for i, (ids, lab) in enumerate(examples):
        got_ids, got_lab = store.example(i)
        assert got_ids.dtype == np.int32 and got_lab.dtype == np.int32
        assert got_ids.tolist() == list(ids) and got_lab.tolist() == list(lab)


@pytest.mark.parametrize("chunk_tokens", [1, 8, 1 << 22])
def test_round_trip_ragged(tmp_path, chunk_tokens):
    store = write(tmp_path, iter(EXAMPLES), chunk_tokens=chunk_tokens, meta_fn=lambda: {"clean": {"empty": 2}})
    _check(store, EXAMPLES)
    _check(TokenStore.open(store.path), EXAMPLES)
    assert store.meta["n_examples"] == len(EXAMPLES)
    assert store.meta["n_tokens"] == sum(len(i) for i, _ in EXAMPLES)
    assert store.meta["clean"] == {"empty": 2} and store.meta["group_size"] == 1
    assert not leftovers(tmp_path, store.path.name), "temp dir left behind"


def test_arrays_are_memory_maps_of_plain_npy(tmp_path):
    store = write(tmp_path, EXAMPLES)
    for arr in (store.tokens, store.labels, store.offsets):
        assert isinstance(arr, np.memmap)
    ids, _ = store.example(4)
    assert np.shares_memory(ids, store.tokens)            # a view, not a copy
    # Plain .npy files: numpy reads them without pickle, fully, too.
    full = np.load(store.path / "tokens.npy", allow_pickle=False)
    assert full.tolist() == [t for ids, _ in EXAMPLES for t in ids]
    assert np.load(store.path / "offsets.npy").dtype == np.int64


def test_pickles_by_path(tmp_path):
    store = write(tmp_path, EXAMPLES)
    blob = pickle.dumps(store)
    assert len(blob) < 500
    _check(pickle.loads(blob), EXAMPLES)


def test_rejects_bad_examples(tmp_path):
    with pytest.raises(ValueError, match="example 1: 2 input_ids but 1 labels"):
        write(tmp_path, [([1], [1]), ([1, 2], [1])])
    with pytest.raises(ValueError, match="outside int32"):
        write(tmp_path, [([2**31], [1])])
    with pytest.raises(ValueError, match="reserved"):
        write(tmp_path, EXAMPLES, meta_fn=lambda: {"n_tokens": 3})
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].endswith(".lock"), f"a failed write left a store or a temp dir: {left}"


def test_group_size(tmp_path):
    pairs = [([1, 2], [IGNORE, 2]), ([1, 3], [IGNORE, 3]), ([4], [4]), ([5, 6, 7], [5, 6, 7])]
    store = write(tmp_path / "dpo", pairs, group_size=2)
    assert store.group_size == 2 and store.n_groups == 2
    assert json.loads((store.path / "meta.json").read_text())["group_size"] == 2
    with pytest.raises(ValueError, match="not a multiple of group_size 2"):
        write(tmp_path / "odd", pairs[:3], group_size=2)


def _counting_build(examples):
    calls = []

    def build():
        calls.append(1)
        yield from examples
    return build, calls


def test_cache_builds_once(tmp_path):
    build, calls = _counting_build(EXAMPLES)
    report = {}

    def examples_with_report():
        for ex in build():
            report["n"] = report.get("n", 0) + 1
            yield ex

    a = cached_token_store(tmp_path, KEY, examples_with_report, meta_fn=lambda: {"clean_report": dict(report)})
    b = cached_token_store(tmp_path, dict(reversed(list(KEY.items()))), examples_with_report)
    assert len(calls) == 1
    assert a.path == b.path and a.path.parent == tmp_path.resolve()
    _check(b, EXAMPLES)
    assert b.meta["clean_report"] == {"n": len(EXAMPLES)}     # meta_fn ran after the stream ended
    assert json.loads((a.path / "key_parts.json").read_text()) == KEY


def test_cache_rebuilds_on_other_key(tmp_path):
    build, calls = _counting_build(EXAMPLES)
    a = cached_token_store(tmp_path, KEY, build)
    b = cached_token_store(tmp_path, {**KEY, "seq_len": 128}, lambda: iter(EXAMPLES[:2]))
    assert a.path != b.path and len(a) == len(EXAMPLES) and len(b) == 2
    c = cached_token_store(tmp_path, KEY, build, group_size=2)     # same data, other grouping: rebuild
    assert len(calls) == 2 and c.group_size == 2


def test_cache_survives_leftover_temp_dir(tmp_path):
    build, calls = _counting_build(EXAMPLES)
    probe = cached_token_store(tmp_path / "probe", KEY, build)
    name = probe.path.name
    stale = tmp_path / "cache" / f".{name}.tmp-crashed"
    stale.mkdir(parents=True)
    (stale / "tokens.npy").write_bytes(b"half")
    store = cached_token_store(tmp_path / "cache", KEY, build)
    _check(store, EXAMPLES)
    assert not stale.exists(), "a dead builder's temp dir was not cleaned up"


@pytest.mark.parametrize("damage", ["truncate_tokens", "drop_meta", "truncate_offsets", "extra_bytes"])
def test_cache_detects_broken_store_and_rebuilds(tmp_path, damage):
    build, calls = _counting_build(EXAMPLES)
    store = cached_token_store(tmp_path, KEY, build)
    path = store.path
    del store
    if damage == "truncate_tokens":
        os.truncate(path / "tokens.npy", (path / "tokens.npy").stat().st_size - 8)
    elif damage == "truncate_offsets":
        os.truncate(path / "offsets.npy", 100)
    elif damage == "drop_meta":
        (path / "meta.json").unlink()
    else:
        with open(path / "labels.npy", "ab") as f:
            f.write(b"\0" * 4)
    with pytest.raises(TokenStoreError):
        TokenStore.open(path)
    store = cached_token_store(tmp_path, KEY, build)
    assert len(calls) == 2
    _check(store, EXAMPLES)


def test_concurrent_builders_build_once(tmp_path):
    build, calls = _counting_build(EXAMPLES)
    barrier = threading.Barrier(4)
    stores, errors = [], []

    def worker():
        barrier.wait()
        try:
            stores.append(cached_token_store(tmp_path, KEY, build))
        except BaseException as e:   # noqa: BLE001
            errors.append(e)

    threads = [threading.Thread(target=worker) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(stores) == 4
    assert len(calls) == 1
    for s in stores:
        _check(s, EXAMPLES)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([stores[0].path.name, f".{stores[0].path.name}.lock"])


def test_streams_large_input_without_lists(tmp_path):
    # A generator of numpy arrays, larger than several chunks: written chunk by chunk.
    rng = np.random.default_rng(0)
    lens = rng.integers(0, 300, size=400)

    def gen():
        for i, n in enumerate(lens):
            ids = np.arange(n, dtype=np.int64) + i
            yield ids, np.where(ids % 2 == 0, ids, IGNORE)

    store = write(tmp_path, gen(), chunk_tokens=1000)
    assert store.lengths().tolist() == lens.tolist()
    ids, lab = store.example(123)
    assert ids.tolist() == (np.arange(lens[123]) + 123).tolist()
    assert lab.tolist() == np.where(ids % 2 == 0, ids, IGNORE).tolist()
