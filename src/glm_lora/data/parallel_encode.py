"""Tokenising a large pretraining or SFT split in worker processes: the same examples in the same order, the same
cleaning report, sooner.

Rows are encoded in chunks of CHUNK_ROWS. The first chunks are encoded here; once that has taken SERIAL_S and rows
remain, the rest go to `workers` processes, at most two chunks each in flight, and come back in order, each with its
own report merged into the split's. The workers are forked, as PyTorch's DataLoader and datasets' map fork theirs:
nothing is imported again and no user script runs again. A small split never starts a process, and neither does a
machine with fewer than MIN_CPUS cores (the 2-core CPU default would only trade its cores between tokenising and
waiting) or without fork. Each row's encoding depends on that row alone, so the token store is byte-identical either way
(tests/data/test_parallel_encode.py).
"""
from __future__ import annotations

import concurrent.futures as cf
import itertools
import multiprocessing
import os
import time
from collections import deque
from typing import Iterable, Iterator

import numpy as np

from glm_lora.data.cleaning import CleanReport
from glm_lora.data.encode import lm_examples, sft_examples

CHUNK_ROWS = 2048
SERIAL_S = 2.0          # encoding this long here first: a split done by then never pays for starting processes
MIN_CPUS = 4
MAX_WORKERS = 16
ENCODERS = {"pretrain": lm_examples, "sft": sft_examples}
WORKERS_ENV = "GLM_LORA_TOKENIZE_WORKERS"       # a number of processes instead of default_workers(); 0: none


def default_workers() -> int:
    """Processes for a large split: $GLM_LORA_TOKENIZE_WORKERS where set; else one per core but one (the reader,
    cleaner and writer), at most MAX_WORKERS, and 0 (encode here) below MIN_CPUS cores."""
    if (env := os.environ.get(WORKERS_ENV, "").strip()):
        if not env.isdigit():
            raise ValueError(f"${WORKERS_ENV} must be a whole number of processes (0: none), got {env!r}")
        return int(env)
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return min(cpus - 1, MAX_WORKERS) if cpus >= MIN_CPUS else 0


def encoded(kind: str, rows: Iterable, tok, report: CleanReport, *, workers: int | None = None,
            serial_s: float | None = None, **options) -> Iterator:
    """`ENCODERS[kind](rows, tok, report=report, **options)`'s examples, in its order, with chunks past the first
    `serial_s` seconds (default SERIAL_S) encoded by `workers` processes (default `default_workers()`; 0: all
    here)."""
    encode = ENCODERS[kind]
    workers = default_workers() if workers is None else workers
    if "fork" not in multiprocessing.get_all_start_methods():
        workers = 0         # spawned workers would import the user's main script again: encode everything here
    serial_s = SERIAL_S if serial_s is None else serial_s
    chunks = _chunks(iter(rows))
    t0 = time.perf_counter()
    for chunk in chunks:
        yield from encode(chunk, tok, report=report, **options)
        if workers > 0 and time.perf_counter() - t0 >= serial_s:
            break
    else:
        return
    global _TOKENIZER
    _TOKENIZER = tok        # the forked workers inherit it
    with cf.ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        pending: deque[cf.Future] = deque()
        for chunk in itertools.chain(chunks, [None]):
            if chunk is not None:
                pending.append(pool.submit(_encode_chunk, kind, chunk, report.max_examples, options))
            while pending and (chunk is None or len(pending) >= 2 * workers):
                examples, part = pending.popleft().result()
                report.merge(part)
                yield from examples


def _chunks(rows: Iterator) -> Iterator[list]:
    while chunk := list(itertools.islice(rows, CHUNK_ROWS)):
        yield chunk


_TOKENIZER = None


def _encode_chunk(kind: str, chunk: list, max_examples: int, options: dict) -> tuple[list, CleanReport]:
    report = CleanReport(max_examples=max_examples)
    examples = [(np.asarray(ids, dtype=np.int32), np.asarray(labels, dtype=np.int32))
                for ids, labels in ENCODERS[kind](chunk, _TOKENIZER, report=report, **options)]
    return examples, report
