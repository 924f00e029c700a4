"""GPU micro-benchmark: Triton RoPE (q and k in one launch) vs eager and torch.compile'd references, fwd+bwd.

B × T = 8 × 2048 (M = 16384 positions), bf16, q/k as the (B, H, T, D) transposed views of the
(B, T, H, D) projections that model.Attention passes. Head configs: the 125M bench model (h768: 12/12
heads of 64), TinyLlama-like h2048 (32 q / 4 kv heads of 64), 16 q / 4 kv heads of 128, and GLM-4-9B's
layout (32 q / 2 kv heads of 128, interleaved pairs over the first 64 dims: partial rotary). --smoke: B × T = 1 × 16,
one small head config per layout, fp32 on the CPU (bench/kernels/timing.py).

    python -m bench.kernels.rope [--smoke]
"""
from __future__ import annotations

import functools

import torch

from bench.kernels.timing import compare, device_from_cli, dtype_for, write
from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_rope import apply_rope

B, T = 8, 2048
# (q heads, kv heads, head_dim, rotary dims, interleaved)
HEADS = ((12, 12, 64, 64, False), (32, 4, 64, 64, False), (16, 4, 128, 128, False), (32, 2, 128, 64, True))
SMOKE_B, SMOKE_T, SMOKE_HEADS = 1, 16, ((4, 2, 32, 32, False), (4, 2, 32, 16, True))


def shapes(device: torch.device) -> tuple[int, int, tuple]:
    """(B, T, head configs): the GPU's or the smoke run's."""
    return (B, T, HEADS) if device.type == "cuda" else (SMOKE_B, SMOKE_T, SMOKE_HEADS)


def bench(device: torch.device) -> list[dict]:
    rows = []
    gen = torch.Generator(device).manual_seed(0)
    dtype = dtype_for(device)
    B, T, heads = shapes(device)
    for H, Hkv, D, R, interleaved in heads:
        torch._dynamo.reset()          # fresh compile caches: the recompile limit counts per code object
        q = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen).transpose(1, 2).requires_grad_(True)
        k = torch.randn(B, T, Hkv, D, device=device, dtype=dtype, generator=gen).transpose(1, 2).requires_grad_(True)
        pos = torch.arange(T, device=device).expand(B, T)
        cos, sin = ref.rope_cos_sin(pos, R, 10000.0, interleaved)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        impls = {"triton": functools.partial(apply_rope, interleaved=interleaved),
                 "eager": functools.partial(ref.apply_rope, interleaved=interleaved),
                 "compiled": torch.compile(functools.partial(ref.apply_rope, interleaved=interleaved), dynamic=False)}
        shape = f"B{B} T{T} H{H} Hkv{Hkv} D{D}" + (f" R{R} interleaved" if interleaved else "")
        rows += compare("rope", shape, dtype, impls, (q, k, cos, sin), (dq, dk))
    return rows


def main() -> None:
    device = device_from_cli(__doc__)
    write("kernels_rope", bench(device), device)


if __name__ == "__main__":
    main()
