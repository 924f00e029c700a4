"""Token-budget batches with packing: several documents per row, none attending to another.

A micro-batch is `rows × seq_len` token slots. Rows are filled best-fit from a look-ahead buffer
of upcoming examples (in sampler order), so short documents fill the gaps long ones leave.
Each document keeps its own positions (restarting at 0) and a document id; the model turns the
ids into a block-diagonal causal mask and the DPO loss sums log-probs per document.
Groups (a DPO chosen/rejected pair) always land in the same row, next to each other.

Batch dict (int64 tensors unless noted):
    input_ids, labels, position_ids, doc_ids   (rows, seq_len); doc id 0 = padding
    target_positions                           flat indices into labels[:, 1:] that are not IGNORE
    num_tokens                                 real (non-padding) tokens (int: no device sync to read it)
    packed                                     bool: rows hold several documents (needs the doc mask)
    capacity                                   rows × seq_len
    group_docs                                 (n_groups, group_size) doc ids of each group, in order
    group_labels                               (n_groups,) each group's label, from a source that has them (KTO)
    data_state                                 dict: sampler + look-ahead state right after this batch
"""
from __future__ import annotations

from typing import Iterator, Protocol

import numpy as np
import torch

from glm_lora.data.token_store import IGNORE


class ExampleSource(Protocol):
    def __len__(self) -> int: ...
    def lengths(self) -> np.ndarray: ...
    def example(self, i: int) -> tuple[np.ndarray, np.ndarray]: ...


def place(rows: list[list[tuple[np.ndarray, np.ndarray]]], seq_len: int, group_size: int,
          packed: bool = True) -> dict[str, torch.Tensor]:
    """Lay out rows of documents into tensors; `rows[r]` lists (ids, labels) in order.

    `packed=False` (one document per row, padding at the end) tells the model that plain causal
    attention suffices; doc_ids still drive the per-document sums of the DPO loss.
    """
    n_rows = len(rows)
    input_ids = np.zeros((n_rows, seq_len), dtype=np.int64)
    labels = np.full((n_rows, seq_len), IGNORE, dtype=np.int64)
    position_ids = np.zeros((n_rows, seq_len), dtype=np.int64)
    doc_ids = np.zeros((n_rows, seq_len), dtype=np.int64)
    doc, real = 0, 0
    for r, docs in enumerate(rows):
        col = 0
        for ids, lab in docs:
            n = len(ids)
            doc += 1
            input_ids[r, col:col + n] = ids
            labels[r, col:col + n] = lab
            labels[r, col] = IGNORE              # a document's first token is never a target
            position_ids[r, col:col + n] = np.arange(n)
            doc_ids[r, col:col + n] = doc
            col += n
        real += col
    groups = torch.arange(1, doc + 1).view(-1, group_size)
    # Flat indices of the (rows, seq_len - 1) next-token targets that are labelled: the loss runs the
    # lm_head on those rows only, without a device→host sync to find them.
    targets = np.flatnonzero(labels[:, 1:] != IGNORE)
    return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
            "target_positions": torch.from_numpy(targets),
            "position_ids": torch.from_numpy(position_ids), "doc_ids": torch.from_numpy(doc_ids),
            "num_tokens": real, "capacity": n_rows * seq_len, "group_docs": groups,
            "packed": packed}


class PackedBatches:
    """Endless packed micro-batches from `source` in the order `order` yields example groups.

    `order` yields group indices (for group_size 2: pair i = examples 2i, 2i+1). The look-ahead
    buffer and the order's own state make up `state_dict()`, so a resumed run continues with the
    same batches.
    """

    def __init__(self, source: ExampleSource, order: Iterator[int], *, rows: int, seq_len: int,
                 group_size: int = 1, lookahead: int = 256):
        self.source, self.order, self.rows, self.seq_len = source, order, rows, seq_len
        self.group_size, self.lookahead = group_size, lookahead
        lengths = source.lengths()
        self.group_len = lengths.reshape(-1, group_size).sum(1)
        too_long = int((self.group_len > seq_len).sum())
        if too_long:
            raise ValueError(f"{too_long} examples are longer than seq_len {seq_len}; truncate or drop them first")
        self.buffer: list[int] = []

    def _fill(self) -> None:
        while len(self.buffer) < self.lookahead:
            try:
                self.buffer.append(next(self.order))
            except StopIteration:   # a finite order: drain the buffer, then stop
                return

    def _row(self) -> list[int]:
        """Best fit: repeatedly take the longest buffered group that still fits the row."""
        free, taken = self.seq_len, []
        lens = self.group_len[self.buffer]
        while True:
            fits = np.flatnonzero(lens <= free)
            if fits.size == 0:
                return taken
            j = int(fits[np.argmax(lens[fits])])
            taken.append(self.buffer.pop(j))
            free -= int(lens[j])
            lens = np.delete(lens, j)

    def __iter__(self):
        return self

    def data_state(self) -> dict:
        """Everything needed to continue exactly after the batch just built (sampler + buffer)."""
        order_state = self.order.state_dict() if hasattr(self.order, "state_dict") else None
        return {"order": order_state, "packer": self.state_dict()}

    def __next__(self) -> dict[str, torch.Tensor]:
        rows, placed = [], []
        for _ in range(self.rows):
            self._fill()
            groups = self._row()
            if groups:
                rows.append([self.source.example(g * self.group_size + k) for g in groups
                             for k in range(self.group_size)])
                placed += groups
        if not rows:
            raise StopIteration
        # Taken here, in the producer: with prefetching the consumer is behind the sampler, so a
        # checkpoint must store the state that came with the last batch it trained on.
        return {**place(rows, self.seq_len, self.group_size), **_group_labels(self.source, placed),
                "data_state": self.data_state()}

    def state_dict(self) -> dict:
        return {"buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = list(state["buffer"])


def padded_batches(source: ExampleSource, order: Iterator[int], *, batch_size: int, group_size: int = 1,
                   ) -> Iterator[dict[str, torch.Tensor]]:
    """The baseline: `batch_size` groups per batch, each document in its own row, padded to the longest."""
    while True:
        groups = [next(order) for _ in range(batch_size)]
        docs = [source.example(g * group_size + k) for g in groups for k in range(group_size)]
        width = max(len(ids) for ids, _ in docs)
        state = {"order": order.state_dict() if hasattr(order, "state_dict") else None, "packer": None}
        yield {**place([[d] for d in docs], width, group_size, packed=False), **_group_labels(source, groups),
               "data_state": state}


def _group_labels(source: ExampleSource, groups: list[int]) -> dict[str, torch.Tensor]:
    """{"group_labels": the placed groups' labels, in group_docs order} for a source with labels (KTO), else {}."""
    labels = source.group_labels() if hasattr(source, "group_labels") else None
    return {} if labels is None else {"group_labels": torch.from_numpy(labels[groups])}
