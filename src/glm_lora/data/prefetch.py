"""Batches built ahead of compute: a background thread runs the batch iterator into a bounded queue.

The thread does the CPU work (sampling, packing, collation) and pins the tensors; the consumer
thread (the training loop) moves them to the device with `non_blocking=True`. Doing the copy in
the consumer puts it on the training loop's current CUDA stream, so the compute that follows is
ordered after it with no extra synchronisation, and the caching host allocator keeps each
pinned buffer alive until its copy has finished. Only top-level tensor values are moved; every
other value (e.g. a `data_state` snapshot for checkpointing, see data/sampler.py) passes through
untouched.

The training loop times its own io-wait around `next()` (engine/trainer.py): the queue wait, or with
depth=0 building the batch itself; the device copy is queued, not waited for.
"""
from __future__ import annotations

import queue
import threading
from typing import Iterator

import torch

_POLL_S = 0.1        # how often a blocked producer re-checks for close()


class _End:
    pass


class _Failed:
    def __init__(self, exc: BaseException):
        self.exc = exc


def _produce(batches: Iterator[dict], q: queue.Queue, stop: threading.Event, pin: bool) -> None:
    # A plain function, not a method: the thread must not hold a reference to the Prefetcher,
    # or an abandoned Prefetcher would never be garbage-collected (and so never closed).
    try:
        while not stop.is_set():
            try:
                batch = next(batches)
            except StopIteration:
                _put(q, _End(), stop)
                return
            if not _put(q, _pin(batch) if pin else batch, stop):
                break
    except BaseException as e:  # noqa: BLE001 - re-raised in the consumer with its traceback
        _put(q, _Failed(e), stop)
        return
    if hasattr(batches, "close"):
        batches.close()   # stopped by close(): run the source generator's cleanup in the thread that runs it


def _put(q: queue.Queue, item: object, stop: threading.Event) -> bool:
    """Put, giving up (False) if close() is called while the queue stays full."""
    while not stop.is_set():
        try:
            q.put(item, timeout=_POLL_S)
            return True
        except queue.Full:
            pass
    return False


def _pin(batch: dict) -> dict:
    return {k: v.pin_memory() if isinstance(v, torch.Tensor) and v.device.type == "cpu" else v
            for k, v in batch.items()}


class Prefetcher:
    """Iterate `batches` `depth` batches ahead in a background thread; yield them on `device`.

    depth=0 is synchronous (no thread, same interface): for debugging and deterministic tests.
    Use as a context manager or call close(); an abandoned one is closed when collected.
    """

    def __init__(self, batches: Iterator[dict], *, depth: int = 2, device: torch.device | str = "cpu",
                 pin_memory: bool | None = None):
        if depth < 0:
            raise ValueError(f"prefetch depth must be >= 0, got {depth}")
        self.device = torch.device(device)
        self.pin_memory = self.device.type == "cuda" if pin_memory is None else pin_memory
        self.depth = depth
        self._batches = iter(batches)
        self._done = False
        self._closed = False
        self._thread: threading.Thread | None = None
        if depth > 0:
            self._queue: queue.Queue = queue.Queue(maxsize=depth)
            self._stop = threading.Event()
            self._thread = threading.Thread(target=_produce, name="glm-lora-prefetch", daemon=True,
                                            args=(self._batches, self._queue, self._stop, self.pin_memory))
            self._thread.start()

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> dict:
        if self._closed:
            raise RuntimeError("Prefetcher is closed")
        if self._done:
            raise StopIteration
        if self._thread is None:
            try:
                batch = next(self._batches)
            except BaseException:
                self._done = True      # like a generator: once it has ended or failed, it stays ended
                raise
            if self.pin_memory:
                batch = _pin(batch)
        else:
            item = self._queue.get()
            if isinstance(item, (_End, _Failed)):
                self._done = True
                self._thread.join()    # it returns right after putting these
                if isinstance(item, _End):
                    raise StopIteration
                raise item.exc         # keeps the producer's traceback, adds ours on top
            batch = item
        return {k: v.to(self.device, non_blocking=self.pin_memory) if isinstance(v, torch.Tensor) else v
                for k, v in batch.items()}

    def close(self) -> None:
        """Stop the producer after the batch it is building and join it; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._thread is not None:
            self._stop.set()
            while True:                 # drop queued batches (frees their pinned memory)
                try:
                    self._queue.get_nowait()
                except queue.Empty:
                    break
            self._thread.join()
        elif hasattr(self._batches, "close"):
            self._batches.close()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> "Prefetcher":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        if getattr(self, "_closed", True) is False:
            self.close()
