"""Token-budget batches with packing: several documents per row, none attending to another.

A micro-batch is `rows × seq_len` token slots. Rows are filled best-fit from a look-ahead buffer
of upcoming examples (in sampler order), so short documents fill the gaps long ones leave.
Each document keeps its own positions (restarting at 0) and a document id; the model turns the
ids into a block-diagonal causal mask and the DPO loss sums log-probs per document.
Groups (a DPO chosen/rejected pair) always land in the same row, next to each other. With
`share_prefix`, a group's common prompt is placed once: [prompt][chosen][rejected], each answer attending
to the prompt and to itself (`prefix_docs`), at the positions it has alone — the same log-probs from fewer
tokens (Wang et al. 2024, "Accelerating Direct Preference Optimization with Prefix Sharing").

Batch dict (int64 tensors unless noted):
    input_ids, labels, position_ids, doc_ids   (rows, seq_len); doc id 0 = padding
    target_positions                           flat indices into labels[:, 1:] that are not IGNORE
    num_tokens                                 real (non-padding) tokens (int: no device sync to read it)
    packed                                     bool: rows hold several documents (needs the doc mask)
    capacity                                   rows × seq_len
    group_docs                                 (n_groups, group_size) doc ids of each group, in order
    prefix_docs                                (rows, seq_len), with share_prefix only: the doc id of the shared
                                               prompt a token also attends to, -1 for none
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


def shared_prefix(docs: list[tuple[np.ndarray, np.ndarray]]) -> int:
    """How many leading tokens a group's documents can share: those all of them have, unlabelled, but the
    last — each document keeps that one, whose hidden state predicts its own first answer token."""
    if len(docs) < 2:
        return 0
    n = min(len(ids) for ids, _ in docs)
    first_ids = docs[0][0][:n]
    same = np.ones(n, dtype=bool)
    for ids, lab in docs:
        same &= (ids[:n] == first_ids) & (lab[:n] == IGNORE)
    common = n if same.all() else int(np.argmin(same))
    return max(common - 1, 0)


def place(rows: list[list[tuple[np.ndarray, np.ndarray]]], seq_len: int, group_size: int,
          packed: bool = True, shared: list[int] | None = None) -> dict[str, torch.Tensor]:
    """Lay out rows of documents into tensors; `rows[r]` lists (ids, labels) in order, `group_size` per group.

    `packed=False` (one document per row, padding at the end) tells the model that plain causal
    attention suffices; doc_ids still drive the per-document sums of the DPO loss. `shared`: each group's
    `shared_prefix` length, in placing order; those tokens are placed once, as a document of their own
    without labels (None: nothing shared, and no `prefix_docs`).
    """
    n_rows = len(rows)
    input_ids = np.zeros((n_rows, seq_len), dtype=np.int64)
    labels = np.full((n_rows, seq_len), IGNORE, dtype=np.int64)
    position_ids = np.zeros((n_rows, seq_len), dtype=np.int64)
    doc_ids = np.zeros((n_rows, seq_len), dtype=np.int64)
    prefix_docs = np.full((n_rows, seq_len), -1, dtype=np.int64)
    doc, real, groups = 0, 0, []
    starts = iter(shared or ())
    for r, docs in enumerate(rows):
        col = 0
        for g in range(0, len(docs), group_size):
            group = docs[g:g + group_size]
            start, prompt = next(starts, 0), doc + 1
            if start:
                doc += 1
                input_ids[r, col:col + start] = group[0][0][:start]
                position_ids[r, col:col + start] = np.arange(start)
                doc_ids[r, col:col + start] = doc
                col += start
            groups.append([])
            for ids, lab in group:
                n = len(ids) - start
                doc += 1
                groups[-1].append(doc)
                input_ids[r, col:col + n] = ids[start:]
                labels[r, col:col + n] = lab[start:]
                labels[r, col] = IGNORE              # a document's first token is never a target
                position_ids[r, col:col + n] = np.arange(start, start + n)
                doc_ids[r, col:col + n] = doc
                if start:
                    prefix_docs[r, col:col + n] = prompt
                col += n
        real += col
    # Flat indices of the (rows, seq_len - 1) next-token targets that are labelled: the loss runs the
    # lm_head on those rows only, without a device→host sync to find them.
    targets = np.flatnonzero(labels[:, 1:] != IGNORE)
    prefixes = {} if shared is None else {"prefix_docs": torch.from_numpy(prefix_docs)}
    return {"input_ids": torch.from_numpy(input_ids), "labels": torch.from_numpy(labels),
            "target_positions": torch.from_numpy(targets),
            "position_ids": torch.from_numpy(position_ids), "doc_ids": torch.from_numpy(doc_ids),
            "num_tokens": real, "capacity": n_rows * seq_len,
            "group_docs": torch.tensor(groups, dtype=torch.long).view(-1, group_size),
            "packed": packed, **prefixes}


class PackedBatches:
    """Endless packed micro-batches from `source` in the order `order` yields example groups.

    `order` yields group indices (for group_size 2: pair i = examples 2i, 2i+1). The look-ahead
    buffer and the order's own state make up `state_dict()`, so a resumed run continues with the
    same batches. `share_prefix`: groups place their common prompt once (see `place`), and are fitted
    into rows at that length.
    """

    def __init__(self, source: ExampleSource, order: Iterator[int], *, rows: int, seq_len: int,
                 group_size: int = 1, lookahead: int = 256, share_prefix: bool = False):
        self.source, self.order, self.rows, self.seq_len = source, order, rows, seq_len
        self.group_size, self.lookahead = group_size, lookahead
        self.share_prefix = share_prefix and group_size > 1
        lengths = source.lengths()
        self.full_len = lengths.reshape(-1, group_size).sum(1)
        too_long = int((self.full_len > seq_len).sum())
        if too_long:
            raise ValueError(f"{too_long} examples are longer than seq_len {seq_len}; truncate or drop them first")
        self.shared_len = np.zeros_like(self.full_len)   # a buffered group's prompt placed once (share_prefix)
        self.group_len = self.full_len.copy()              # what a buffered group takes in a row
        self.buffer: list[int] = []

    def _docs(self, g: int) -> list[tuple[np.ndarray, np.ndarray]]:
        return [self.source.example(g * self.group_size + k) for k in range(self.group_size)]

    def _admit(self, g: int) -> None:
        if self.share_prefix:
            self.shared_len[g] = shared_prefix(self._docs(g))
            self.group_len[g] = self.full_len[g] - (self.group_size - 1) * self.shared_len[g]

    def _fill(self) -> None:
        while len(self.buffer) < self.lookahead:
            try:
                self.buffer.append(next(self.order))
            except StopIteration:   # a finite order: drain the buffer, then stop
                return
            self._admit(self.buffer[-1])

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
                rows.append([doc for g in groups for doc in self._docs(g)])
                placed += groups
        if not rows:
            raise StopIteration
        # Taken here, in the producer: with prefetching the consumer is behind the sampler, so a
        # checkpoint must store the state that came with the last batch it trained on.
        shared = self.shared_len[placed].tolist() if self.share_prefix else None
        return {**place(rows, self.seq_len, self.group_size, shared=shared),
                **_group_labels(self.source, placed),
                "data_state": self.data_state()}

    def state_dict(self) -> dict:
        return {"buffer": list(self.buffer)}

    def load_state_dict(self, state: dict) -> None:
        self.buffer = list(state["buffer"])
        for g in self.buffer:
            self._admit(g)


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


def to_device(batch: dict, device: torch.device) -> dict:
    """A batch's tensors moved to `device` (host→device copies overlap with compute)."""
    return {k: v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v for k, v in batch.items()}
