"""GPU micro-benchmark: fused LoRA linear, forward + backward (dx, dA, dB), bf16, M = 16384 rows.

Same process, same tensors, per in→out ∈ {2048→2048, 2048→5632, 5632→2048}, r ∈ {16, 64} and
LoRA dropout ∈ {0, 0.1} (training mode):
  base      the frozen base GEMM alone, y = x Wᵀ and dx = dy W: the floor (target: ours ≤ 1.15×)
  peft      PEFT's lora.Linear wrapping an nn.Linear (base weight frozen, adapters in bf16)
  eager     kernels.reference.lora_linear
  compiled  torch.compile(kernels.reference.lora_linear)
  triton    kernels.triton_lora_linear.lora_linear (cuBLAS GEMMs + the Triton dropout kernels)
Rows also carry ratio_vs_base and ratio_vs_peft. "lora_down_proj" rows time the skinny x Aᵀ alone
(forward): cuBLAS vs the Triton kernel, and dropout-then-cuBLAS vs the fused Triton kernel.
--smoke: M = 64, 64 → 64, r = 8, fp32 on the CPU, each call once, no "compiled" (bench/kernels/timing.py).

    python -m bench.kernels.lora_linear [--smoke]
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from bench.kernels.timing import (SKIP_COMPILED, device_from_cli, dtype_for, measure, median_ms, ratio, rounded, rows,
                                  skipped, write)
from glm_lora.kernels import reference as ref
from glm_lora.kernels import triton_lora_linear as tll

SHAPES = ((2048, 2048), (2048, 5632), (5632, 2048))
RANKS = (16, 64)
DROPOUTS = (0.0, 0.1)
SMOKE_SHAPES, SMOKE_RANKS = ((64, 64),), (8,)


def _peft_layer(weight: torch.Tensor, r: int, alpha: float, dropout: float):
    from peft import LoraConfig
    from peft.tuners.lora import Linear

    base = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    base.weight = torch.nn.Parameter(weight, requires_grad=False)
    layer = Linear(base, "default", LoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout), r=r, lora_alpha=alpha)
    layer.to(device=weight.device, dtype=weight.dtype).train()
    torch.nn.init.normal_(layer.lora_B["default"].weight, std=r ** -0.5)
    return layer, layer.lora_A["default"].weight, layer.lora_B["default"].weight


def _lora_rows(k: int, n: int, r: int, p: float, gen: torch.Generator, device: torch.device) -> list[dict]:
    dtype, alpha, M = dtype_for(device), 2.0 * r, rows(device)
    scale = alpha / r
    x = torch.randn(M, k, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    w = torch.randn(n, k, device=device, dtype=dtype, generator=gen) * k ** -0.5
    a = (torch.randn(r, k, device=device, dtype=dtype, generator=gen) * k ** -0.5).requires_grad_(True)
    b = (torch.randn(n, r, device=device, dtype=dtype, generator=gen) * r ** -0.5).requires_grad_(True)
    dy = torch.randn(M, n, device=device, dtype=dtype, generator=gen)
    peft_layer, peft_a, peft_b = _peft_layer(w, r, alpha, p)
    torch._dynamo.reset()              # fresh compile caches: the recompile limit counts per code object
    compiled = torch.compile(ref.lora_linear, dynamic=False)
    impls = {
        "base": (lambda x: F.linear(x, w), (x,)),
        "peft": (lambda x, a, b: peft_layer(x), (x, peft_a, peft_b)),
        "eager": (lambda x, a, b: ref.lora_linear(x, w, a, b, scale, p, True), (x, a, b)),
        "compiled": (lambda x, a, b: compiled(x, w, a, b, scale, p, True), (x, a, b)),
        "triton": (lambda x, a, b: tll.lora_linear(x, w, a, b, scale, p, True), (x, a, b)),
    }
    out = []
    for impl, (fn, inputs) in impls.items():
        row = {"op": "lora_linear", "shape": f"{M}x{k}->{n}", "r": r, "dropout": p,
               "dtype": str(dtype).removeprefix("torch."), "impl": impl}
        if skipped(impl, device):
            out.append({**row, "skipped": SKIP_COMPILED})
            continue
        ms, peak_mb = measure(fn, inputs, (dy,))
        out.append({**row, "ms": rounded(ms, 4), "peak_mem_mb": rounded(peak_mb, 1)})
    by_impl = {row["impl"]: row.get("ms") for row in out}
    for row in out:
        for other in ("base", "peft", "eager"):
            row[f"ratio_vs_{other}"] = ratio(row.get("ms"), by_impl[other])
    return out


def _down_proj_rows(k: int, r: int, gen: torch.Generator, device: torch.device) -> list[dict]:
    dtype, M = dtype_for(device), rows(device)
    x = torch.randn(M, k, device=device, dtype=dtype, generator=gen)
    a = torch.randn(r, k, device=device, dtype=dtype, generator=gen) * k ** -0.5
    seed = tll.dropout_seed(device)
    impls = {
        "cublas": lambda: x @ a.t(),
        "triton": lambda: tll.lora_down(x, a),
        "dropout_then_cublas": lambda: F.dropout(x, 0.1) @ a.t(),
        "triton_fused_dropout": lambda: tll.lora_down(x, a, seed, 0.1),
    }
    out = []
    for impl, fn in impls.items():
        if device.type == "cuda":
            fn()
        ms = median_ms(fn, device, warmup=25, rep=200)
        out.append({"op": "lora_down_proj", "shape": f"{M}x{k}", "r": r, "dtype": str(dtype).removeprefix("torch."),
                    "impl": impl, "ms": rounded(ms, 4)})
    return out


def bench(device: torch.device) -> list[dict]:
    out = []
    gen = torch.Generator(device).manual_seed(0)
    shapes, ranks = (SHAPES, RANKS) if device.type == "cuda" else (SMOKE_SHAPES, SMOKE_RANKS)
    for k, n in shapes:
        for r in ranks:
            for p in DROPOUTS:
                out += _lora_rows(k, n, r, p, gen, device)
    for k in sorted({k for k, _ in shapes}):
        for r in ranks:
            out += _down_proj_rows(k, r, gen, device)
    return out


def main() -> None:
    device = device_from_cli(__doc__)
    write("kernels_lora_linear", bench(device), device)


if __name__ == "__main__":
    main()
