"""GPU micro-benchmark: the LoRA term folded into the base GEMM (kernels/triton_lora_gemm.py), bf16, M = 16384 rows.

Same process, same tensors, per in→out ∈ {2048→2048, 2048→5632, 5632→2048} (the 1B shapes) and r ∈ {16, 64};
each the median of triton.testing.do_bench (warm-up and repetitions as its defaults), interleaved per shape:
  forward  y = x Wᵀ (+ s·(x Aᵀ) Bᵀ)
    base     cuBLAS x Wᵀ alone: the floor (target: folded ≤ 1.10× at the 1B shapes, ≤ 1.3× at 2048→2048)
    cublas   today's fused path: xa = x Aᵀ, y = s·xa Bᵀ, y += x Wᵀ (cuBLAS, beta = 1)
    folded   xa = x Aᵀ (cuBLAS), then one Triton GEMM x Wᵀ with s·xa Bᵀ in its epilogue
    gemm     the folded GEMM at s = 0 (the epilogue still runs): the Triton GEMM vs cuBLAS itself
  dx       dx = dy W (+ s·(dy B) A): the same four
The whole LoRA linear forward + backward (dx, dA, dB) with folding off / on: `lora_linear` rows.
--smoke: M = 64, 64 → 64, r = 8, fp32 on the CPU, each call once (bench/kernels/timing.py).

    python -m bench.kernels.lora_gemm [--smoke]
"""
from __future__ import annotations

import torch

from bench.kernels.timing import device_from_cli, dtype_for, measure, median_ms, ratio, rounded, rows, write
from glm_lora.kernels import triton_lora_linear as tll
from glm_lora.kernels.reference import scaled_mm
from glm_lora.kernels.triton_lora_gemm import lora_gemm

SHAPES = ((2048, 2048), (2048, 5632), (5632, 2048))     # (in, out)
RANKS = (16, 64)
SMOKE_SHAPES, SMOKE_RANKS = ((64, 64),), (8,)
SCALE = 2.0


def _cublas_lora(a, b, p, q):
    y = scaled_mm(p, q, SCALE)
    return y.addmm_(a, b)


def bench(device: torch.device) -> list[dict]:
    out = []
    cuda = device.type == "cuda"
    M = rows(device)
    _ms = lambda fn: median_ms(fn, device)                                              # noqa: E731
    g = torch.Generator(device).manual_seed(0)
    for k, n in SHAPES if cuda else SMOKE_SHAPES:
        for r in RANKS if cuda else SMOKE_RANKS:
            rnd = lambda *s: torch.randn(*s, generator=g, device=device, dtype=dtype_for(device))     # noqa: E731
            x, w, a, b, dy = rnd(M, k), rnd(n, k) * k ** -0.5, rnd(r, k) * k ** -0.5, rnd(n, r) * r ** -0.5, rnd(M, n)
            for form, (lhs, rhs, down, up) in {"forward": (x, w.t(), a.t(), b.t()), "dx": (dy, w, b, a)}.items():
                p = lhs @ down                                      # x Aᵀ or dy B: computed first on both paths
                t = {"base": _ms(lambda: lhs @ rhs),
                     "cublas": _ms(lambda: _cublas_lora(lhs, rhs, lhs @ down, up)),
                     "folded": _ms(lambda: lora_gemm(lhs, rhs, lhs @ down, up, SCALE)),
                     "gemm": _ms(lambda: lora_gemm(lhs, rhs, p, up, 0.0))}

                err = (lora_gemm(lhs, rhs, p, up, SCALE).float() - _cublas_lora(lhs, rhs, p, up).float()).abs().max()
                out.append({"op": form, "shape": f"{M}x{k}->{n}", "r": r, **{f"{key}_ms": rounded(v, 4) for key, v in t.items()},
                            "cublas_vs_base": ratio(t["cublas"], t["base"]),
                            "folded_vs_base": ratio(t["folded"], t["base"]),
                            "triton_gemm_vs_cublas_gemm": ratio(t["gemm"], t["base"]),
                            "max_abs_diff_vs_cublas_path": float(err)})
            lin = []
            for fold in (False, True):
                tll.FOLD_INTO_GEMM = fold
                xs = x.detach().requires_grad_(True)
                aa, bb = a.detach().requires_grad_(True), b.detach().requires_grad_(True)
                lin.append(measure(lambda x_, a_, b_: tll.lora_linear(x_, w, a_, b_, SCALE), [xs, aa, bb], [dy])[0])
            tll.FOLD_INTO_GEMM = False
            out.append({"op": "lora_linear fwd+bwd", "shape": f"{M}x{k}->{n}", "r": r, "cublas_ms": rounded(lin[0], 4),
                        "folded_ms": rounded(lin[1], 4), "folded_vs_cublas": ratio(lin[1], lin[0])})
    return out


def main() -> None:
    device = device_from_cli(__doc__)
    write("kernels_lora_gemm", bench(device), device)


if __name__ == "__main__":
    main()
