"""GPU micro-benchmark: Triton SwiGLU vs eager and torch.compile'd references, fwd+bwd.

Rows M = 16384, intermediate 2048 (the h768 bench model) and 5632 (h2048), bf16.

    python -m bench.kernels.swiglu
"""
from __future__ import annotations

import torch

from bench.kernels.rms_norm import M, compare
from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_swiglu import swiglu

INTERMEDIATE = (2048, 5632)


def bench(device: str = "cuda") -> list[dict]:
    rows = []
    gen = torch.Generator(device).manual_seed(0)
    dtype = torch.bfloat16
    for inter in INTERMEDIATE:
        torch._dynamo.reset()          # fresh compile caches: the recompile limit counts per code object
        gate = torch.randn(M, inter, device=device, dtype=dtype, generator=gen).requires_grad_(True)
        up = torch.randn(M, inter, device=device, dtype=dtype, generator=gen).requires_grad_(True)
        dy = torch.randn(M, inter, device=device, dtype=dtype, generator=gen)
        impls = {"triton": swiglu, "eager": ref.swiglu, "compiled": torch.compile(ref.swiglu, dynamic=False)}
        rows += compare("swiglu", f"{M}x{inter}", dtype, impls, (gate, up), (dy,))
    return rows


if __name__ == "__main__":
    from bench.common import write_result
    print("->", write_result("kernels_swiglu", {"rows": bench()}))
