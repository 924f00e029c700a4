"""GPU micro-benchmark: Triton RoPE (q and k in one launch) vs eager and torch.compile'd references, fwd+bwd.

B × T = 8 × 2048 (M = 16384 positions), bf16, q/k as the (B, H, T, D) transposed views of the
(B, T, H, D) projections that model.Attention passes. Head configs: the 125M bench model (h768: 12/12
heads of 64), TinyLlama-like h2048 (32 q / 4 kv heads of 64) and 16 q / 4 kv heads of 128.

    python -m bench.kernels.rope
"""
from __future__ import annotations

import torch

from bench.kernels.rms_norm import compare
from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_rope import apply_rope

B, T = 8, 2048
HEADS = ((12, 12, 64), (32, 4, 64), (16, 4, 128))      # (q heads, kv heads, head_dim)


def bench(device: str = "cuda") -> list[dict]:
    rows = []
    gen = torch.Generator(device).manual_seed(0)
    dtype = torch.bfloat16
    for H, Hkv, D in HEADS:
        torch._dynamo.reset()          # fresh compile caches: the recompile limit counts per code object
        q = torch.randn(B, T, H, D, device=device, dtype=dtype, generator=gen).transpose(1, 2).requires_grad_(True)
        k = torch.randn(B, T, Hkv, D, device=device, dtype=dtype, generator=gen).transpose(1, 2).requires_grad_(True)
        pos = torch.arange(T, device=device).expand(B, T)
        cos, sin = ref.rope_cos_sin(pos, D, 10000.0)
        dq, dk = torch.randn_like(q), torch.randn_like(k)
        impls = {"triton": apply_rope, "eager": ref.apply_rope, "compiled": torch.compile(ref.apply_rope, dynamic=False)}
        rows += compare("rope", f"B{B} T{T} H{H} Hkv{Hkv} D{D}", dtype, impls, (q, k, cos, sin), (dq, dk))
    return rows


if __name__ == "__main__":
    from bench.common import write_result
    print("->", write_result("kernels_rope", {"rows": bench()}))
