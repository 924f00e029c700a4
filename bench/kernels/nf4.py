"""GPU micro-benchmark: QLoRA's 4-bit base (model/quant.py, kernels/triton_nf4.py, kernels/qlora.py), bf16.

  dequantize_nf4   packed NF4 + double-quantised scales → the bf16 weight, per weight shape:
                   triton (kernels/triton_nf4.py), eager (kernels.reference), compiled (torch.compile of it);
                   GB/s counts the bytes read (0.52 a weight) and written (2 a weight)
  lora_linear      forward + backward (dx, dA, dB), M = 16384 rows, r = 16, no dropout, in training mode:
                   bf16      kernels.lora_linear on the bf16 weight (the fused path "auto" takes on CUDA)
                   nf4       kernels.nf4_lora_linear (W dequantised by Triton in forward and again in backward)
                   peak_mem_mb counts what a step allocates beyond its inputs; resident_mb the base weight held
--smoke: a 64 × 64 weight, M = 64, fp32 on the CPU, each call once, no "compiled" (bench/kernels/timing.py).

    python -m bench.kernels.nf4 [--smoke]
"""
from __future__ import annotations

import torch

from bench.kernels.timing import (SKIP_COMPILED, device_from_cli, dtype_for, measure, median_ms, ratio, rounded, rows,
                                  skipped, write)
from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference as ref
from glm_lora.model.quant import quantize_nf4

SHAPES = ((2048, 2048), (5632, 2048), (2048, 5632), (11008, 4096))     # (out, in)
SMOKE_SHAPES = ((64, 64),)
R = 16


def _dequant_rows(out_f: int, in_f: int, gen: torch.Generator, device: torch.device) -> list[dict]:
    dtype = dtype_for(device)
    q = quantize_nf4(torch.randn(out_f, in_f, device=device, generator=gen, dtype=dtype) * 0.02)
    parts = (q.packed, q.absmax_codes, q.nested_absmax, q.offset, q.code, q.nested_code, dtype)
    from glm_lora.kernels.triton_nf4 import dequantize_nf4
    torch._dynamo.reset()
    impls = {"triton": lambda: dequantize_nf4(*parts), "eager": lambda: ref.dequantize_nf4(*parts),
             "compiled": torch.compile(lambda: ref.dequantize_nf4(*parts), dynamic=False)}
    out = []
    n = out_f * in_f
    for impl, fn in impls.items():
        row = {"op": "dequantize_nf4", "shape": f"{out_f}x{in_f}", "dtype": str(dtype).removeprefix("torch."), "impl": impl}
        if skipped(impl, device):
            out.append({**row, "skipped": SKIP_COMPILED})
            continue
        if device.type == "cuda":
            fn()
        ms = median_ms(fn, device, warmup=25, rep=200)
        out.append({**row, "ms": rounded(ms, 4), "gb_per_s": ms and round((q.nbytes + 2 * n) / ms / 1e6, 1)})
    return out


def _linear_rows(out_f: int, in_f: int, gen: torch.Generator, device: torch.device) -> list[dict]:
    dtype, M = dtype_for(device), rows(device)
    x = torch.randn(M, in_f, device=device, dtype=dtype, generator=gen).requires_grad_(True)
    w = torch.randn(out_f, in_f, device=device, dtype=dtype, generator=gen) * in_f ** -0.5
    a = (torch.randn(R, in_f, device=device, dtype=dtype, generator=gen) * in_f ** -0.5).requires_grad_(True)
    b = (torch.randn(out_f, R, device=device, dtype=dtype, generator=gen) * R ** -0.5).requires_grad_(True)
    dy = torch.randn(M, out_f, device=device, dtype=dtype, generator=gen)
    q = quantize_nf4(w)
    impls = {"bf16": (lambda x, a, b: kernels.lora_linear(x, w, a, b, 2.0, 0.0, True), w.nbytes),
             "nf4": (lambda x, a, b: kernels.nf4_lora_linear(x, q, a, b, 2.0, 0.0, True), q.nbytes)}
    out = []
    for impl, (fn, resident) in impls.items():
        ms, peak_mb = measure(fn, (x, a, b), (dy,))
        out.append({"op": "lora_linear", "shape": f"{M}x{in_f}->{out_f}", "r": R, "dtype": str(dtype).removeprefix("torch."),
                    "impl": impl, "ms": rounded(ms, 4), "peak_mem_mb": rounded(peak_mb, 1),
                    "resident_mb": round(resident / 2**20, 2)})
    bf16_ms = out[0]["ms"]
    for row in out:
        row["ratio_vs_bf16"] = ratio(row["ms"], bf16_ms)
    return out


def bench(device: torch.device) -> list[dict]:
    gen = torch.Generator(device).manual_seed(0)
    shapes = SHAPES if device.type == "cuda" else SMOKE_SHAPES
    out = []
    for out_f, in_f in shapes:
        out += _dequant_rows(out_f, in_f, gen, device)
    for out_f, in_f in shapes[:3]:
        out += _linear_rows(out_f, in_f, gen, device)
    return out


def main() -> None:
    device = device_from_cli(__doc__)
    # "auto" takes the fused Triton path on CUDA only: the smoke run (interpreter) asks for it by name
    with kernels.using("auto" if device.type == "cuda" else "triton"):
        write("kernels_nf4", bench(device), device)


if __name__ == "__main__":
    main()
