"""GPU probe: Triton RoPE's time per layout at several HEAD_TILE values (q or k elements one program rotates),
several measures each, sorted. Run it in the baseline tree too (its kernel then ignores HEAD_TILE; tag "base").

    python -m bench.kernels.rope_tiles TAG [TILE,TILE,...]      (bench/results/rope_head_blocks_2026-12-05_h100.txt)
"""
from __future__ import annotations

import functools
import sys

import torch

from bench.kernels.rms_norm import measure
from bench.kernels.rope import B, HEADS, T
from glm_lora.kernels import reference as ref
from glm_lora.kernels import triton_rope

MEASURES = 5


def main(tag: str, tiles: list[int | None]) -> None:
    gen = torch.Generator("cuda").manual_seed(0)
    for tile in tiles:
        if tile is not None:
            triton_rope.HEAD_TILE = tile
        for H, Hkv, D, R, interleaved in HEADS:
            q = torch.randn(B, T, H, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
            k = torch.randn(B, T, Hkv, D, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
            q.requires_grad_(True), k.requires_grad_(True)
            cos, sin = ref.rope_cos_sin(torch.arange(T, device="cuda").expand(B, T), R, 10000.0, interleaved)
            fn = functools.partial(triton_rope.apply_rope, interleaved=interleaved)
            ms = sorted(measure(fn, (q, k, cos, sin), (torch.randn_like(q), torch.randn_like(k)))[0]
                        for _ in range(MEASURES))
            print(tag, "tile", tile, f"H{H}/{Hkv} D{D} R{R}", "interleaved" if interleaved else "halves",
                  [round(m, 4) for m in ms], flush=True)


if __name__ == "__main__":
    main(sys.argv[1], [int(x) for x in sys.argv[2].split(",")] if len(sys.argv) > 2 else [None])
