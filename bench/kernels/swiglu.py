"""GPU micro-benchmark: Triton SwiGLU vs eager and torch.compile'd references, fwd+bwd.

Rows M = 16384, intermediate 2048 (the h768 bench model) and 5632 (h2048), bf16. --smoke: M = 64,
intermediate 64, fp32 on the CPU (bench/kernels/timing.py).

    python -m bench.kernels.swiglu [--smoke]
"""
from __future__ import annotations

import torch

from bench.kernels.timing import compare, device_from_cli, dtype_for, rows, write
from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_swiglu import swiglu

INTERMEDIATE, SMOKE_INTERMEDIATE = (2048, 5632), (64,)


def bench(device: torch.device) -> list[dict]:
    out = []
    gen = torch.Generator(device).manual_seed(0)
    dtype, m = dtype_for(device), rows(device)
    for inter in INTERMEDIATE if device.type == "cuda" else SMOKE_INTERMEDIATE:
        torch._dynamo.reset()          # fresh compile caches: the recompile limit counts per code object
        gate = torch.randn(m, inter, device=device, dtype=dtype, generator=gen).requires_grad_(True)
        up = torch.randn(m, inter, device=device, dtype=dtype, generator=gen).requires_grad_(True)
        dy = torch.randn(m, inter, device=device, dtype=dtype, generator=gen)
        impls = {"triton": swiglu, "eager": ref.swiglu, "compiled": torch.compile(ref.swiglu, dynamic=False)}
        out += compare("swiglu", f"{m}x{inter}", dtype, impls, (gate, up), (dy,))
    return out


def main() -> None:
    device = device_from_cli(__doc__)
    write("kernels_swiglu", bench(device), device)


if __name__ == "__main__":
    main()
