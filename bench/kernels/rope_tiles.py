"""GPU probe: Triton RoPE's time per layout at several HEAD_TILE values (q or k elements one program rotates),
several measures each, sorted. Run it in the baseline tree too (its kernel then ignores HEAD_TILE; tag "base").
--smoke: rope's smoke shapes on the CPU, one untimed call per tile and layout (bench/kernels/timing.py).

    python -m bench.kernels.rope_tiles TAG [TILE,TILE,...] [--smoke]   (bench/results/rope_head_blocks_2026-12-05_h100.txt)
"""
from __future__ import annotations

import argparse
import functools

import torch

from bench.kernels.rope import shapes
from bench.kernels.timing import dtype_for, measure, rounded
from glm_lora.kernels import reference as ref
from glm_lora.kernels import triton_rope

MEASURES = 5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("tag")
    ap.add_argument("tiles", nargs="?", type=lambda s: [int(x) for x in s.split(",")], default=[None])
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU, one untimed call (TRITON_INTERPRET=1)")
    args = ap.parse_args()
    device = torch.device("cpu" if args.smoke else "cuda")
    probe(args.tag, args.tiles, device, 1 if args.smoke else MEASURES)


def probe(tag: str, tiles: list[int | None], device: torch.device, measures: int) -> None:
    gen = torch.Generator(device).manual_seed(0)
    B, T, heads = shapes(device)
    for tile in tiles:
        if tile is not None:
            triton_rope.HEAD_TILE = tile
        for H, Hkv, D, R, interleaved in heads:
            q = torch.randn(B, T, H, D, device=device, dtype=dtype_for(device), generator=gen).transpose(1, 2)
            k = torch.randn(B, T, Hkv, D, device=device, dtype=dtype_for(device), generator=gen).transpose(1, 2)
            q.requires_grad_(True), k.requires_grad_(True)
            cos, sin = ref.rope_cos_sin(torch.arange(T, device=device).expand(B, T), R, 10000.0, interleaved)
            fn = functools.partial(triton_rope.apply_rope, interleaved=interleaved)
            ms = [measure(fn, (q, k, cos, sin), (torch.randn_like(q), torch.randn_like(k)))[0] for _ in range(measures)]
            print(tag, "tile", tile, f"H{H}/{Hkv} D{D} R{R}", "interleaved" if interleaved else "halves",
                  [rounded(m, 4) for m in sorted(ms, key=lambda m: m or 0)], flush=True)


if __name__ == "__main__":
    main()
