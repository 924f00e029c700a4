"""LoRA folded into the base GEMM: C = A·B + scale · P·Q in one Triton GEMM, the rank-r product in its epilogue.

For a LoRA linear, forward y = x Wᵀ + s·(x Aᵀ) Bᵀ is A = x, B = Wᵀ, P = x Aᵀ (M×r, computed first by cuBLAS),
Q = Bᵀ; the input gradient dx = dy W + s·(dy B) A is A = dy, B = W, P = dy B, Q = A. Each output tile
accumulates its K loop in fp32, then adds s·(P tile · Q tile) — r ≤ 128 columns, one more tl.dot — and is
rounded once: no M×N LoRA term is written and read back (the cuBLAS path, kernels/triton_lora_linear.py,
writes s·P·Q first and lets the base GEMM accumulate onto it). Operands are passed with their strides, so
Wᵀ / W need no copy. Same numbers as `kernels.reference.lora_gemm` up to fp32 summation order.

Measured on the H200 (bench/kernels/lora_gemm.py): this GEMM runs 1.27–1.78× cuBLAS's time for the same
product, so folding loses to the cuBLAS path (kernels/triton_lora_linear.py), and `FOLD_INTO_GEMM` there
is off; a variant moving tiles by TMA descriptors measured no better and was not kept.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# The interpreter has no autotuner (no driver): one small config there (tl.dot needs tiles >= 16).
INTERPRETER_CONFIG = dict(BLOCK_M=32, BLOCK_N=32, BLOCK_K=32, GROUP_M=2)
GPU_CONFIGS = [triton.Config(dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=64, GROUP_M=8), num_stages=s, num_warps=w)
               for bm, bn, s, w in ((128, 256, 3, 8), (256, 128, 3, 8), (128, 128, 4, 8), (128, 128, 4, 4),
                                    (128, 256, 4, 8), (64, 256, 4, 4))]
MAX_RANK = 128


@triton.jit
def _lora_gemm_kernel(a_ptr, b_ptr, p_ptr, q_ptr, c_ptr, M, N, K, R, scale,
                      s_am, s_ak, s_bk, s_bn, s_pm, s_pr, s_qr, s_qn, s_cm, s_cn,
                      BLOCK_R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      GROUP_M: tl.constexpr):
    # grouped ordering: GROUP_M row-tiles share each column of B while it is in L2
    pid = tl.program_id(0)
    tiles_m, tiles_n = tl.cdiv(M, BLOCK_M), tl.cdiv(N, BLOCK_N)
    group = pid // (GROUP_M * tiles_n)
    first_m = group * GROUP_M
    group_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % group_m
    pid_n = (pid % (GROUP_M * tiles_n)) // group_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_m, in_n = rm[:, None] < M, rn[None, :] < N
    a_tile = a_ptr + rm[:, None].to(tl.int64) * s_am + rk[None, :] * s_ak
    b_tile = b_ptr + rk[:, None] * s_bk + rn[None, :].to(tl.int64) * s_bn
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = tl.load(a_tile, mask=in_m & (rk[None, :] < K - k0), other=0.0)
        b = tl.load(b_tile, mask=(rk[:, None] < K - k0) & in_n, other=0.0)
        acc = tl.dot(a, b, acc)
        a_tile += BLOCK_K * s_ak
        b_tile += BLOCK_K * s_bk

    rr = tl.arange(0, BLOCK_R)
    p = tl.load(p_ptr + rm[:, None].to(tl.int64) * s_pm + rr[None, :] * s_pr, mask=in_m & (rr[None, :] < R), other=0.0)
    q = tl.load(q_ptr + rr[:, None] * s_qr + rn[None, :].to(tl.int64) * s_qn, mask=(rr[:, None] < R) & in_n, other=0.0)
    acc += scale * tl.dot(p, q)
    c = c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=in_m & in_n)


_autotuned = None if _INTERPRET else triton.autotune(GPU_CONFIGS, key=["M", "N", "K", "BLOCK_R"])(_lora_gemm_kernel)


def lora_gemm(a: torch.Tensor, b: torch.Tensor, p: torch.Tensor, q: torch.Tensor, scale: float) -> torch.Tensor:
    """a (M, K) · b (K, N) + scale · p (M, R) · q (R, N), any strides, in a's dtype (fp32 accumulation)."""
    (M, K), (K2, N), (M2, R), (R2, N2) = a.shape, b.shape, p.shape, q.shape
    if (K, M, R, N) != (K2, M2, R2, N2):
        raise ValueError(f"lora_gemm: shapes {tuple(a.shape)} · {tuple(b.shape)} + {tuple(p.shape)} · {tuple(q.shape)} "
                         "do not chain")
    if R > MAX_RANK:
        raise ValueError(f"lora_gemm: rank {R} > {MAX_RANK} (the epilogue holds a whole rank-wide tile)")
    c = torch.empty(M, N, dtype=a.dtype, device=a.device)
    args = (a, b, p, q, c, M, N, K, R, float(scale), *a.stride(), *b.stride(), *p.stride(), *q.stride(), *c.stride())
    block_r = max(16, triton.next_power_of_2(R))
    if _autotuned is None:
        cfg = INTERPRETER_CONFIG
        grid = (triton.cdiv(M, cfg["BLOCK_M"]) * triton.cdiv(N, cfg["BLOCK_N"]),)
        _lora_gemm_kernel[grid](*args, BLOCK_R=block_r, **cfg)
        return c
    grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]) * triton.cdiv(N, meta["BLOCK_N"]),)  # noqa: E731
    _autotuned[grid](*args, BLOCK_R=block_r)
    return c
