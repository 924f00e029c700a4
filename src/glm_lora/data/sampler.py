"""Deterministic, resumable, rank-sharded order over n sampling units (examples, or DPO pairs).

Epoch e is a permutation drawn from (seed, e) alone, so any epoch can be rebuilt without
replaying earlier ones; rank r of world_size takes positions r, r + world_size, ... of it.

State, `state_dict()` (plain JSON): `epoch` and `position` say how far `next()` has got — the epoch
of the last index handed out and how many of this rank's indices of it were handed out (0, 0 before
the first) — and `n`, `seed`, `world_size`, `rank`, `shuffle`, `drop_last` say which order it is;
`load_state_dict` refuses a state of another order. Loaded into a fresh sampler, the state taken
after k `next()` calls makes the fresh one's first `next()` return what the old one's (k+1)-th would.

Resume contract:
- A packer that pulls indices into a look-ahead buffer owns those indices: its own state must
  hold the buffer contents (pulled, not yet emitted), and resume = load the sampler state +
  restore the buffer. Indices are never "given back" to the sampler.
- With a prefetcher, the producer runs ahead of training, so the sampler's live state is ahead
  of what has been trained on. The batch builders (data/packing.py) therefore snapshot
  `{"order": sampler.state_dict(), "packer": {"buffer": [...]} or None}` into each batch they build
  (`data_state`, a non-tensor value passed through untouched), and the checkpoint saves the
  snapshot of the last batch *consumed*. The sampler is not thread-safe: only the producer thread
  touches it.
- Rank and world size only shard the order; nothing here starts processes or joins a process group,
  and a checkpoint holds the one `data_state` of the process that wrote it.
"""
from __future__ import annotations

import os
from typing import Iterator

import numpy as np
import torch

_SEED_STRIDE = 1_000_003      # seed * stride + epoch: distinct (seed, epoch) pairs → distinct torch seeds


class EpochSampler:
    """Endless indices in [0, n): epoch 0, 1, 2, ... each a fresh permutation, this rank's share of it.

    Without drop_last every epoch is padded by wrapping around its permutation so all ranks get
    ceil(n / world_size) indices (a few repeat); with drop_last the tail is cut to n // world_size.
    """

    def __init__(self, n: int, *, seed: int, shuffle: bool = True, rank: int = 0, world_size: int = 1,
                 drop_last: bool = False):
        if n <= 0:
            raise ValueError(f"sampler over n={n} items: the dataset is empty")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not in [0, world_size={world_size})")
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        if drop_last and n < world_size:
            raise ValueError(f"drop_last with n={n} < world_size={world_size} leaves every rank empty")
        self.n, self.seed, self.shuffle = n, seed, shuffle
        self.rank, self.world_size, self.drop_last = rank, world_size, drop_last
        self.num_samples = n // world_size if drop_last else -(-n // world_size)   # per rank per epoch
        self._epoch, self._position = 0, 0
        self._order_epoch, self._order = -1, np.empty(0, dtype=np.int64)

    @classmethod
    def from_env(cls, n: int, *, seed: int, **kwargs) -> "EpochSampler":
        """Rank and world size from the RANK / WORLD_SIZE environment variables (0 / 1 when unset)."""
        return cls(n, seed=seed, rank=int(os.environ.get("RANK", 0)),
                   world_size=int(os.environ.get("WORLD_SIZE", 1)), **kwargs)

    @property
    def epoch(self) -> int:
        """Epoch of the last index handed out (0 before the first)."""
        return self._epoch

    @property
    def position(self) -> int:
        """Indices already handed out in `epoch` (num_samples once it is finished)."""
        return self._position

    def epoch_order(self, epoch: int) -> np.ndarray:
        """This rank's indices for `epoch`, in order (int64)."""
        if epoch != self._order_epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * _SEED_STRIDE + epoch)
                perm = torch.randperm(self.n, generator=g).numpy()
            else:
                perm = np.arange(self.n, dtype=np.int64)
            total = self.num_samples * self.world_size
            perm = np.resize(perm, total)     # wraps around to pad (repeats if n < world_size), or cuts
            order = perm[self.rank::self.world_size]
            order.flags.writeable = False
            self._order_epoch, self._order = epoch, order
        return self._order

    def __iter__(self) -> Iterator[int]:
        return self

    def __next__(self) -> int:
        if self._position == self.num_samples:
            self._epoch, self._position = self._epoch + 1, 0
        i = int(self.epoch_order(self._epoch)[self._position])
        self._position += 1           # before returning: the state counts what the caller has
        return i

    def state_dict(self) -> dict:
        """Where `next()` has got (epoch, position) and which order this is (see the module docstring)."""
        return {"epoch": self._epoch, "position": self._position, "seed": self.seed, "n": self.n,
                "world_size": self.world_size, "rank": self.rank, "shuffle": self.shuffle,
                "drop_last": self.drop_last}

    def load_state_dict(self, state: dict) -> None:
        """Continue exactly where `state` left off; refuse a state from a different order."""
        for field in ("n", "seed", "world_size", "rank", "shuffle", "drop_last"):
            if field in state and state[field] != getattr(self, field):
                raise ValueError(f"sampler state has {field}={state[field]!r} but this sampler has "
                                 f"{field}={getattr(self, field)!r}; resuming would change the data order")
        for field in ("n", "seed", "world_size"):
            if field not in state:
                raise ValueError(f"sampler state lacks {field!r}")
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position <= self.num_samples:
            raise ValueError(f"sampler state epoch={epoch}, position={position} is out of range "
                             f"(position must be in [0, {self.num_samples}])")
        self._epoch, self._position = epoch, position
