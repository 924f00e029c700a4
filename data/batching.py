"""Tokenised examples → training batches.

Pretraining concatenates documents (EOS between them) into fixed blocks; SFT and DPO pad
examples to the longest in the batch. Token-budget packing with per-document attention
replaces the padding path in the data-pipeline issue; the batch dict shape stays the same:
`input_ids`, `labels` (aligned with input_ids, -100 = no loss), `num_tokens` (real tokens).
"""
from __future__ import annotations

from typing import Callable, Iterable, Iterator, Sequence

import torch

IGNORE = -100
Example = tuple[list[int], list[int]]   # (input_ids, labels)


def pretrain_blocks(docs: Iterable[list[int]], seq_len: int, eos_id: int) -> list[Example]:
    """Concatenate documents with EOS and cut into blocks of seq_len tokens (tail dropped)."""
    stream: list[int] = []
    for ids in docs:
        stream.extend(ids)
        stream.append(eos_id)
    n = len(stream) // seq_len
    blocks = [stream[i * seq_len:(i + 1) * seq_len] for i in range(n)]
    return [(b, b) for b in blocks]


def truncate(example: Example, seq_len: int) -> Example:
    ids, labels = example
    return ids[:seq_len], labels[:seq_len]


def pad_batch(examples: Sequence[Example], pad_id: int) -> dict[str, torch.Tensor]:
    width = max(len(ids) for ids, _ in examples)
    input_ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    for row, (ids, lab) in enumerate(examples):
        input_ids[row, :len(ids)] = torch.tensor(ids)
        labels[row, :len(lab)] = torch.tensor(lab)
    return {"input_ids": input_ids, "labels": labels,
            "num_tokens": torch.tensor(sum(len(ids) for ids, _ in examples))}


def pad_pairs(pairs: Sequence[tuple[Example, Example]], pad_id: int) -> dict[str, torch.Tensor]:
    """DPO: chosen rows first, then rejected rows, in one padded batch (one forward pass)."""
    return pad_batch([c for c, _ in pairs] + [r for _, r in pairs], pad_id)


def shuffled_batches(items: Sequence, batch_size: int, collate: Callable[[list], dict], seed: int) -> Iterator[dict]:
    """Endless batches over reshuffled epochs; the same seed gives the same order."""
    if not items:
        raise ValueError("no training examples left after tokenisation/truncation")
    g = torch.Generator().manual_seed(seed)
    while True:
        order = torch.randperm(len(items), generator=g).tolist()
        for i in range(0, len(order) - batch_size + 1 if len(order) >= batch_size else 1, batch_size):
            yield collate([items[j] for j in order[i:i + batch_size]])
