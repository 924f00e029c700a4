"""Prefetcher: same batches in the same order, errors surface, a queue that hides a slow producer, thread joined."""
from __future__ import annotations

import gc
import itertools
import threading
import time
import traceback

import pytest
import torch

from glm_lora.data.prefetch import Prefetcher
from glm_lora.data.sampler import EpochSampler


def source(n: int, delay: float = 0.0):
    for i in range(n):
        if delay:
            time.sleep(delay)
        yield {"input_ids": torch.full((2, 3), i), "num_tokens": torch.tensor(6), "tag": f"b{i}", "meta": {"i": i}}


@pytest.mark.parametrize("depth", [0, 1, 2, 5])
def test_same_batches_in_order(depth):
    with Prefetcher(source(7), depth=depth) as p:
        got = list(p)
        with pytest.raises(StopIteration):           # stays ended
            next(p)
    assert [b["tag"] for b in got] == [f"b{i}" for i in range(7)]
    for i, b in enumerate(got):
        assert torch.equal(b["input_ids"], torch.full((2, 3), i))
        assert b["meta"] == {"i": i}                  # non-tensors pass through untouched


def _exploding():
    yield {"x": torch.zeros(1)}
    raise KeyError("row 17 is broken")


@pytest.mark.parametrize("depth", [0, 2])
def test_exception_propagates_with_traceback(depth):
    p = Prefetcher(_exploding(), depth=depth)
    next(p)
    with pytest.raises(KeyError, match="row 17") as info:
        next(p)
    frames = [f.name for f in traceback.extract_tb(info.value.__traceback__)]
    assert "_exploding" in frames, frames               # the producer's frame is kept
    with pytest.raises(StopIteration):
        next(p)
    assert not p.alive
    p.close()


def _timed_next(p: Prefetcher) -> float:
    """Seconds blocked in next(p): what the training loop records as io-wait."""
    t0 = time.perf_counter()
    next(p)
    return time.perf_counter() - t0


@pytest.mark.parametrize("depth", [0, 2])
def test_a_slow_producer_makes_the_consumer_wait(depth):
    with Prefetcher(source(3, delay=0.05), depth=depth) as p:
        for _ in range(3):
            assert _timed_next(p) >= 0.04


def test_fast_consumer_hides_producer_latency():
    with Prefetcher(source(4, delay=0.03), depth=2) as p:
        next(p)
        time.sleep(0.2)                                  # "compute" while the thread fills the queue
        assert _timed_next(p) < 0.02


def test_close_joins_the_thread_and_closes_the_source():
    closed = threading.Event()

    def endless():
        try:
            for i in itertools.count():
                yield {"i": torch.tensor(i)}
        finally:
            closed.set()

    p = Prefetcher(endless(), depth=3)
    assert int(next(p)["i"]) == 0
    time.sleep(0.05)                                     # the queue is now full, the producer blocked
    assert p.alive
    p.close()
    assert not p.alive and closed.is_set()
    with pytest.raises(RuntimeError, match="closed"):
        next(p)
    p.close()                                            # idempotent


def test_garbage_collection_stops_the_thread():
    p = Prefetcher(source(100), depth=2)
    next(p)
    thread = p._thread
    del p
    gc.collect()
    thread.join(timeout=2)
    assert not thread.is_alive()


def test_device_and_no_pinning_on_cpu():
    p = Prefetcher(source(1), depth=1, device="cpu")
    assert p.pin_memory is False
    b = next(p)
    assert b["input_ids"].device.type == "cpu"
    p.close()


def test_resume_through_prefetch_with_state_snapshots():
    """The contract of data/sampler.py: the producer snapshots sampler state into each batch."""
    def batches(sampler):
        while True:
            idx = [next(sampler) for _ in range(3)]
            yield {"idx": torch.tensor(idx), "data_state": sampler.state_dict()}

    reference = Prefetcher(batches(EpochSampler(10, seed=4)), depth=0)
    ref = [next(reference)["idx"].tolist() for _ in range(12)]
    with Prefetcher(batches(EpochSampler(10, seed=4)), depth=3) as p:
        consumed = [next(p) for _ in range(5)]           # the producer is further ahead than this
    state = consumed[-1]["data_state"]
    resumed_sampler = EpochSampler(10, seed=4)
    resumed_sampler.load_state_dict(state)
    with Prefetcher(batches(resumed_sampler), depth=2) as p:
        rest = [next(p)["idx"].tolist() for _ in range(7)]
    assert [b["idx"].tolist() for b in consumed] + rest == ref


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pinned_non_blocking():
    with Prefetcher(source(4), depth=2, device="cuda") as p:
        assert p.pin_memory
        got = list(p)
    for i, b in enumerate(got):
        assert b["input_ids"].is_cuda and b["tag"] == f"b{i}"
        assert torch.equal(b["input_ids"].cpu(), torch.full((2, 3), i))
