"""GPU micro-benchmark: Triton RMSNorm vs eager and torch.compile'd references, fwd+bwd.

Rows M = 16384 (8 × 2048 tokens), hidden 768 and 2048. bf16, plus fp32 because under bf16 autocast
the residual stream (and so the norms' input) stays fp32. "frozen_w" is the LoRA case: the norm
weight needs no gradient. --smoke: M = 64, hidden 64, fp32 on the CPU (bench/kernels/timing.py).

    python -m bench.kernels.rms_norm [--smoke]
"""
from __future__ import annotations

import torch

from bench.kernels.timing import compare, device_from_cli, rows, write
from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_rms_norm import rms_norm

HIDDEN, SMOKE_HIDDEN, EPS = (768, 2048), (64,), 1e-5


def bench(device: torch.device) -> list[dict]:
    cuda = device.type == "cuda"
    m, hidden = rows(device), HIDDEN if cuda else SMOKE_HIDDEN
    out = []
    gen = torch.Generator(device).manual_seed(0)
    for dtype in (torch.bfloat16, torch.float32) if cuda else (torch.float32,):
        for C in hidden:
            torch._dynamo.reset()      # fresh compile caches: the recompile limit counts per code object
            x = torch.randn(m, C, device=device, dtype=dtype, generator=gen).requires_grad_(True)
            w = (1 + 0.1 * torch.randn(C, device=device, dtype=dtype, generator=gen)).requires_grad_(True)
            w_frozen = w.detach()
            dy = torch.randn(m, C, device=device, dtype=dtype, generator=gen)
            norm = {"triton": lambda x, w: rms_norm(x, w, EPS), "eager": lambda x, w: ref.rms_norm(x, w, EPS),
                    "compiled": torch.compile(lambda x, w: ref.rms_norm(x, w, EPS), dynamic=False)}
            out += compare("rms_norm", f"{m}x{C}", dtype, norm, (x, w), (dy,))
            out += compare("rms_norm_frozen_w", f"{m}x{C}", dtype, norm, (x, w_frozen), (dy,))
    return out


def main() -> None:
    device = device_from_cli(__doc__)
    write("kernels_rms_norm", bench(device), device)


if __name__ == "__main__":
    main()
