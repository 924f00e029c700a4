"""Token efficiency (real tokens / computed token slots) of packed token-budget batches vs
padded batches of 8 (DataCollatorForSeq2Seq-style: pad to the longest in the batch), on the
skewed length mix of the data-pipeline issue, in the same run over the same sample order.

    python -m bench.packing_efficiency [--samples 20000] [--seq-len 2048] [--rows 8]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from bench.common import write_result
from glm_lora.data.packing import PackedBatches, padded_batches
from glm_lora.data.sampler import EpochSampler


class LengthsOnly:
    """Examples of the given lengths (token values don't matter for efficiency)."""

    def __init__(self, lengths: np.ndarray):
        self._lengths = lengths

    def __len__(self):
        return len(self._lengths)

    def lengths(self):
        return self._lengths

    def example(self, i):
        n = int(self._lengths[i])
        return np.ones(n, dtype=np.int32), np.ones(n, dtype=np.int32)


def skewed_lengths(n: int, seed: int = 0) -> np.ndarray:
    """80% 16–511, 15% 512–1536, 5% 1537–2048 tokens."""
    rng = np.random.default_rng(seed)
    bucket = rng.choice(3, size=n, p=[0.80, 0.15, 0.05])
    lo, hi = np.array([16, 512, 1537])[bucket], np.array([512, 1537, 2049])[bucket]
    return rng.integers(lo, hi)


def one_epoch(batches, n_docs: int) -> dict:
    real = slots = docs = n = 0
    t0 = time.perf_counter()
    for b in batches:
        real += int(b["num_tokens"])
        slots += int(b["capacity"])
        docs += int(b["doc_ids"].max())
        n += 1
        if docs >= n_docs:
            break
    return {"efficiency": real / slots, "batches": n, "documents": docs, "real_tokens": real, "slots": slots,
            "build_ms_per_batch": 1000 * (time.perf_counter() - t0) / n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--samples", type=int, default=20000)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args()
    src = LengthsOnly(skewed_lengths(args.samples))
    n = len(src)
    padded = one_epoch(padded_batches(src, iter(EpochSampler(n, seed=0)), batch_size=8), n)
    packed = one_epoch(PackedBatches(src, iter(EpochSampler(n, seed=0)), rows=args.rows, seq_len=args.seq_len), n)
    figures = {"samples": n, "mix": "80% 16-511, 15% 512-1536, 5% 1537-2048 tokens",
               "padded_batches_of_8": padded, f"packed_{args.rows}x{args.seq_len}": packed,
               "ratio_packed_over_padded": packed["efficiency"] / padded["efficiency"]}
    path = write_result("packing_efficiency", figures)
    print(f"padded batches of 8: efficiency {padded['efficiency']:.3f}")
    print(f"packed {args.rows}x{args.seq_len}:        efficiency {packed['efficiency']:.3f} "
          f"({packed['build_ms_per_batch']:.1f} ms to build a batch)")
    print(f"-> {path}")


if __name__ == "__main__":
    main()
