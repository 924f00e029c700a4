"""Held-out rows from the user's own file, for a split that has no `*_eval` file of its own.

The data stage picks a seeded, deterministic slice of the good rows (in the order the readers
yield them, bad rows not counted), writes them normalised into the data artifact as
`<split>_eval.jsonl` (so evaluation never re-reads the user's file) and records their row ids in
sources.json; training skips exactly those ids (`without`). Evaluating on rows of the same file
the model trains on is what makes the held-out metrics, validation losses, early stopping and the
promotion gate mean something for the user's data — not for the bundled synthetic tasks.
"""
from __future__ import annotations

import json
import math
import random
import zlib
from pathlib import Path
from typing import Iterable, Iterator

from glm_lora.configs.schema import HoldoutConfig


def holdout_ids(n_rows: int, cfg: HoldoutConfig, max_rows: int, split: str) -> list[int]:
    """Which of `n_rows` good rows to hold out: fraction × n, at least min_rows, at most max_rows,
    and never more than a fifth of the split (training must keep most of it)."""
    k = max(math.ceil(cfg.fraction * n_rows), cfg.min_rows)
    k = min(k, max_rows, n_rows // 5)
    if k < 1:
        return []
    rng = random.Random(cfg.seed * 1_000_003 + zlib.crc32(split.encode()))
    return sorted(rng.sample(range(n_rows), k))


def without(rows: Iterable, ids: Iterable[int]) -> Iterator:
    """The rows whose index (in reading order) is not held out."""
    held = frozenset(ids)
    return (row for i, row in enumerate(rows) if i not in held)


def write_held_out(rows: Iterable, ids: list[int], kind: str, out: Path) -> int:
    """Write rows `ids` (reading order) of a pretrain / sft / dpo reader's output as JSONL the same
    reader reads back; return how many were written."""
    wanted, n = set(ids), 0
    with open(out, "w", encoding="utf-8") as f:
        for i, row in enumerate(rows):
            if i in wanted:
                f.write(json.dumps(_normalised(kind, row), ensure_ascii=False) + "\n")
                n += 1
                if n == len(wanted):
                    break
    return n


def _normalised(kind: str, row) -> dict:
    if kind == "pretrain":
        return {"text": row}
    if kind == "sft":
        return {"messages": row}
    if hasattr(row, "desirable"):           # a KTO row (data.formats.KTORow)
        return {"messages": row.prompt, "completion": row.completion["content"], "label": row.desirable}
    prompt, chosen, rejected = row
    return {"chosen": prompt + [chosen], "rejected": prompt + [rejected]}
