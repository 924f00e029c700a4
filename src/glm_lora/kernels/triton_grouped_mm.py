"""Grouped GEMM for mixture-of-experts layers, plain and with per-group LoRA, in Triton.

A MoE layer sorts its (token, expert) rows by expert, so group g owns the contiguous rows
offsets[g-1]:offsets[g] of x (M, K) (offsets: cumulative end rows, torch._grouped_mm's `offs`; offsets[-1] = M;
empty groups allowed). With W (G, N, K) (one nn.Linear weight per group), A (G, r, K), B (G, N, r), s = scale,
and for every group g on its rows (the math of `kernels.reference.grouped_mm` / `grouped_lora_mm`):

  forward    y   = x Wᵍᵀ                 (+ s · (x Aᵍᵀ) Bᵍᵀ)
  backward   dx  = dy Wᵍ                 (+ s · (dy Bᵍ) Aᵍ)
             dWᵍ = dyᵀ x                  (only when W requires grad: never for a frozen MoE base under LoRA)
             dAᵍ = s · (dy Bᵍ)ᵀ x,  dBᵍ = s · dyᵀ (x Aᵍᵀ)

Two kernels do all of it:

* `_grouped_mm_kernel`, C[rows_g] = L[rows_g] · Rᵍ (+ s · P[rows_g] · Qᵍ), one program per (row tile, N tile)
  (the grouped GEMM of MegaBlocks, Gale et al. 2022). A row tile never crosses a group boundary: each
  program rebuilds the tile → group schedule from `offsets` on the device (tiles_g = ⌈count_g / BLOCK_M⌉,
  their cumulative sum, the program's group = the number of groups whose tiles end at or before its row
  tile), so no host sync: the grid is the fixed bound ⌈M / BLOCK_M⌉ + G row tiles (Σ_g ⌈count_g / BLOCK_M⌉
  never exceeds it), and programs past the real tiles exit. Rᵍ / Qᵍ are
  passed as (G, K, N) / (G, R, N) strided views, so one kernel serves x·Wᵀ (a transposed view of W) and
  dy·W (W as stored), with no copies. With LoRA the rank-r product P·Qᵍ (P = x Aᵀ or dy B, M × r, computed
  first by the same kernel) is an extra accumulation loop over r in the same tile program, after the K loop
  (the epilogue fold of LoRAFusion, Zhu et al. 2025; kernels/triton_lora_gemm.py does it for one dense
  weight): no M × N LoRA term is written and read back.
* `_grouped_wgrad_kernel`, Outᵍ = s · U[rows_g]ᵀ · V[rows_g] (dW, dA, dB), one program per (group, P tile,
  Q tile) looping over the group's rows; an empty group writes zeros. When those programs are too few to fill
  the GPU (the rank-r factors' gradients), the rows are split over `split` programs each writing an fp32
  partial, summed after (deterministic, no atomics).

Every dot accumulates in fp32 and the result is rounded once to the inputs' dtype. Inputs: bf16/fp16 (and
fp32, exact "ieee" dots) on the GPU; under TRITON_INTERPRET=1 fp32/fp16 (bf16 there is upcast to fp32 after
each load: the interpreter's bf16 dot is wrong). Offsets values are validated on the host only where they
already are (CPU tensors) or with CHECK_OFFSET_VALUES: on CUDA that would cost a sync per call. With invalid
offsets on CUDA the kernels stay in bounds (ends clamped to [0, M]) but rows outside the groups are not written.

`torch_grouped_mm` is torch's own grouped GEMM (CUTLASS, bf16 on sm90/sm100) with the same signature, for
comparison (bench/grouped_mm_gpu.py); which one "auto" picks is `kernels.GROUPED_MM_AUTO` / `GROUPED_LORA_MM_AUTO`.

Measured on the H200 (bench/grouped_mm_gpu.py, bf16, 2026-12-03, 16384 tokens × top-8 over 64 experts and
× top-4 over 16, 2048 ↔ 1408, r 16; p50 of forward + backward): the plain grouped GEMM (dx + dW) takes
1.14–1.29× torch._grouped_mm's time (its forward 476 TFLOP/s against CUTLASS's 550 and one dense cuBLAS
GEMM's 670); with LoRA (W frozen) the folded op takes 0.77–0.85× the time of three torch._grouped_mm calls,
0.63–0.75× of three of our grouped passes, with 0.57–0.65× their peak memory. The per-expert loop's forward
takes 1.43–1.48× ours at 64 experts, 0.95× at 16; its backward 5–20× (autograd's slice backward adds a
full-size gradient per expert).
"""
from __future__ import annotations

import contextlib
import os
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from glm_lora.kernels.reference import NF4Stack, check_grouped

# jit functions are bound to the interpreter at import time, so decide once, here.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
CHECK_OFFSET_VALUES = False     # also check offsets' values when they live on CUDA (a host sync per call)
WGRAD_SPLIT: int | None = None  # force the weight-gradient kernel's row split (tests); None: by occupancy


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _tile_group(offs_ptr, G, M, pid_m, BLOCK_M: tl.constexpr, BLOCK_G: tl.constexpr):
    """Row tile pid_m of the grouped schedule → (group, first row, group's end row); group ≥ G: no such tile."""
    gi = tl.arange(0, BLOCK_G)
    in_g = gi < G
    ends = tl.minimum(tl.maximum(tl.load(offs_ptr + gi, mask=in_g, other=0), 0), M)
    starts = tl.load(offs_ptr + tl.maximum(gi - 1, 0), mask=in_g & (gi > 0), other=0)
    starts = tl.minimum(tl.maximum(starts, 0), M)
    counts = tl.where(in_g, tl.maximum(ends - starts, 0), 0)
    tiles = (counts + BLOCK_M - 1) // BLOCK_M
    tiles_end = tl.cumsum(tiles, 0)                           # exclusive end tile of each group
    g = tl.sum((tiles_end <= pid_m).to(tl.int32), 0)          # the first group whose tiles end after pid_m
    here = gi == g
    first_tile = tl.sum(tl.where(here, tiles_end - tiles, 0), 0)
    row0 = tl.sum(tl.where(here, starts, 0), 0) + (pid_m - first_tile) * BLOCK_M
    return g, row0, tl.sum(tl.where(here, ends, 0), 0)


@triton.jit
def _grouped_mm_kernel(l_ptr, r_ptr, c_ptr, p_ptr, q_ptr, offs_ptr, M, N, K, R, G, scale,
                       s_lm, s_lk, s_rg, s_rk, s_rn, s_cm, s_cn, s_pm, s_pr, s_qg, s_qr, s_qn,
                       absmax_codes_ptr, nested_absmax_ptr, offset_ptr, code_ptr, nested_code_ptr, s_ag, s_ng,
                       HAS_LORA: tl.constexpr, NF4: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                       BLOCK_R: tl.constexpr, BLOCK_G: tl.constexpr, GROUP_M: tl.constexpr,
                       NF4_BLOCK: tl.constexpr = 64, NESTED_BLOCK: tl.constexpr = 256):
    """C[rows_g] = L[rows_g] · R[g] (+ scale · P[rows_g] · Q[g]) for one (row tile, N tile). NF4: R[g] is read from
    group g's 4-bit codes (r_ptr: packed bytes) and scales and dequantised in registers, tile by tile."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M) + G                         # bound on the row tiles of any grouping
    tiles_n = tl.cdiv(N, BLOCK_N)
    # GROUP_M consecutive row tiles (mostly one group's) sweep the N tiles together: R[g] stays in L2
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    band_m = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % band_m
    pid_n = (pid % (GROUP_M * tiles_n)) // band_m
    g, row0, row_end = _tile_group(offs_ptr, G, M, pid_m, BLOCK_M, BLOCK_G)
    if g >= G:
        return

    rm = row0 + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    in_m, in_n = rm < row_end, rn < N
    l_tile = l_ptr + rm[:, None].to(tl.int64) * s_lm + rk[None, :] * s_lk
    r_tile = r_ptr + g.to(tl.int64) * s_rg + rk[:, None] * s_rk + rn[None, :].to(tl.int64) * s_rn
    if NF4:     # the element index within group g's weight (< 2³¹: checked by the launcher) and its scale inputs
        w_idx = rk[:, None] * s_rk + rn[None, :] * s_rn
        packed_g = r_ptr + g.to(tl.int64) * s_rg
        codes_g = absmax_codes_ptr + g.to(tl.int64) * s_ag
        nested_g = nested_absmax_ptr + g.to(tl.int64) * s_ng
        offset_g = tl.load(offset_ptr + g)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        lt = tl.load(l_tile, mask=in_m[:, None] & (rk[None, :] < K - k0), other=0.0)
        if NF4:     # kernels.reference.dequantize_nf4's float ops, rounded once to L's dtype
            r_mask = (rk[:, None] < K - k0) & in_n[None, :]
            idx = w_idx + k0 * s_rk
            byte = tl.load(packed_g + (idx >> 1), mask=r_mask, other=0).to(tl.int32)
            nibble = (byte >> ((1 - (idx & 1)) * 4)) & 0xF                      # an even element: the high nibble
            block = idx // NF4_BLOCK
            q = tl.load(codes_g + block, mask=r_mask, other=0).to(tl.int32)
            absmax = tl.load(nested_code_ptr + q) * tl.load(nested_g + block // NESTED_BLOCK, mask=r_mask, other=0.0)
            absmax = absmax + offset_g
            rt = (tl.load(code_ptr + nibble) * absmax).to(l_ptr.dtype.element_ty)
        else:
            rt = tl.load(r_tile, mask=(rk[:, None] < K - k0) & in_n[None, :], other=0.0)
        if UPCAST:
            lt, rt = lt.to(tl.float32), rt.to(tl.float32)
        acc = tl.dot(lt, rt, acc, input_precision=DOT_PRECISION)
        l_tile += BLOCK_K * s_lk
        r_tile += BLOCK_K * s_rk

    if HAS_LORA:
        # acc/s + P·Q, then ·s: the rank-r product lands in the same fp32 registers (a second BLOCK_M × BLOCK_N
        # accumulator would spill at 128 × 256 tiles); the launcher never passes s = 0
        rr = tl.arange(0, BLOCK_R)
        p_tile = p_ptr + rm[:, None].to(tl.int64) * s_pm + rr[None, :] * s_pr
        q_tile = q_ptr + g.to(tl.int64) * s_qg + rr[:, None] * s_qr + rn[None, :].to(tl.int64) * s_qn
        acc = acc * (1.0 / scale)
        for r0 in range(0, R, BLOCK_R):
            pt = tl.load(p_tile, mask=in_m[:, None] & (rr[None, :] < R - r0), other=0.0)
            qt = tl.load(q_tile, mask=(rr[:, None] < R - r0) & in_n[None, :], other=0.0)
            if UPCAST:
                pt, qt = pt.to(tl.float32), qt.to(tl.float32)
            acc = tl.dot(pt, qt, acc, input_precision=DOT_PRECISION)
            p_tile += BLOCK_R * s_pr
            q_tile += BLOCK_R * s_qr
        acc = acc * scale

    c = c_ptr + rm[:, None].to(tl.int64) * s_cm + rn[None, :] * s_cn
    tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=in_m[:, None] & in_n[None, :])


@triton.jit
def _grouped_wgrad_kernel(u_ptr, v_ptr, out_ptr, offs_ptr, M, P, Q, scale,
                          s_um, s_up, s_vm, s_vq, s_os, s_og, s_op, s_oq,
                          UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
                          BLOCK_M: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_Q: tl.constexpr):
    """out[split, g] = scale · U[rows]ᵀ · V[rows] over the split's share of group g's rows, one (P, Q) tile."""
    pid, split, n_split = tl.program_id(0), tl.program_id(1), tl.num_programs(1)
    tiles_p, tiles_q = tl.cdiv(P, BLOCK_P), tl.cdiv(Q, BLOCK_Q)
    g = pid // (tiles_p * tiles_q)
    pid_p = (pid % (tiles_p * tiles_q)) // tiles_q
    pid_q = pid % tiles_q
    start = tl.load(offs_ptr + tl.maximum(g - 1, 0), mask=g > 0, other=0)
    start = tl.minimum(tl.maximum(start, 0), M)
    end = tl.minimum(tl.maximum(tl.load(offs_ptr + g), start), M)

    rp = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    rq = pid_q * BLOCK_Q + tl.arange(0, BLOCK_Q)
    rm = tl.arange(0, BLOCK_M)
    in_p, in_q = rp < P, rq < Q
    acc = tl.zeros((BLOCK_P, BLOCK_Q), dtype=tl.float32)
    row_tiles = tl.cdiv(end - start, BLOCK_M)
    for i in range(0, tl.cdiv(tl.maximum(row_tiles - split, 0), n_split)):    # this split's row tiles
        rows = start + (split + i * n_split) * BLOCK_M + rm
        in_m = rows < end
        ut = tl.load(u_ptr + rows[None, :].to(tl.int64) * s_um + rp[:, None] * s_up,      # Uᵀ tile (P, rows)
                     mask=in_p[:, None] & in_m[None, :], other=0.0)
        vt = tl.load(v_ptr + rows[:, None].to(tl.int64) * s_vm + rq[None, :] * s_vq,
                     mask=in_m[:, None] & in_q[None, :], other=0.0)
        if UPCAST:
            ut, vt = ut.to(tl.float32), vt.to(tl.float32)
        acc = tl.dot(ut, vt, acc, input_precision=DOT_PRECISION)
    out = out_ptr + split.to(tl.int64) * s_os + g.to(tl.int64) * s_og + rp[:, None] * s_op + rq[None, :] * s_oq
    tl.store(out, (acc * scale).to(out_ptr.dtype.element_ty), mask=in_p[:, None] & in_q[None, :])


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

def _np2(n: int, lo: int = 16, hi: int = 128) -> int:
    return min(hi, max(lo, triton.next_power_of_2(n)))


def _dot_args(dtype: torch.dtype) -> dict:
    # fp32 inputs keep full precision (no tf32); half inputs are exact in any mode
    return dict(UPCAST=_INTERPRET and dtype == torch.bfloat16,
                DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")


def mm_config(N: int, K: int, dtype: torch.dtype) -> dict:
    """Block sizes, warps and stages of `_grouped_mm_kernel` for an N-wide output (hand table, H200; the
    interpreter has no autotuner and pays per program, so one config of large tiles there)."""
    if _INTERPRET:
        return dict(BLOCK_M=32, BLOCK_N=_np2(N, 16, 64), BLOCK_K=64, GROUP_M=4)
    if dtype == torch.float32:
        return dict(BLOCK_M=64, BLOCK_N=_np2(N, 16, 64), BLOCK_K=32, GROUP_M=8, num_warps=4, num_stages=3)
    if N <= 64:     # the LoRA down-projections x Aᵀ, dy B (r columns): a stream over the rows
        return dict(BLOCK_M=64, BLOCK_N=_np2(N), BLOCK_K=128, GROUP_M=8, num_warps=4, num_stages=4)
    if N > 512:     # 2048 → 1408 forward, 131072 rows: 1.62 ms against 1.75–2.01 for 128×128 tiles (bench sweep)
        return dict(BLOCK_M=128, BLOCK_N=256, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=3)
    return dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64, GROUP_M=8, num_warps=8, num_stages=4)


def wgrad_config(P: int, Q: int, dtype: torch.dtype) -> dict:
    if _INTERPRET:
        return dict(BLOCK_M=32, BLOCK_P=_np2(P, 16, 64), BLOCK_Q=_np2(Q, 16, 64))
    if dtype == torch.float32:
        return dict(BLOCK_M=32, BLOCK_P=_np2(P, 16, 64), BLOCK_Q=_np2(Q, 16, 64), num_warps=4, num_stages=3)
    return dict(BLOCK_M=64, BLOCK_P=_np2(P), BLOCK_Q=_np2(Q), num_warps=8 if min(P, Q) > 64 else 4, num_stages=3)


class NF4Rhs(NamedTuple):
    """A 4-bit stack W (G, N, K) as `grouped_gemm`'s right operand: Wᵀ (G, K, N) when `transposed` (x·Wᵀ), else W
    as stored (dy·W). Its strides are those of that view of the dequantised weight, in elements."""

    w: NF4Stack
    transposed: bool

    @property
    def shape(self) -> tuple[int, int, int]:
        G, N, K = self.w.shape
        return (G, K, N) if self.transposed else (G, N, K)

    def stride(self) -> tuple[int, int, int]:
        K = self.w.shape[2]
        return (self.w.packed.stride(0), 1, K) if self.transposed else (self.w.packed.stride(0), K, 1)


def nf4_config(N: int, K: int, dtype: torch.dtype) -> dict:
    """`mm_config` for a 4-bit right operand: the dequantised tile lives in registers beside the accumulator, so
    at most 128 × 128 output tiles, and 2 pipeline stages (3 of 128 × 256 ask 256 KiB of shared memory; an H100 has
    227: bench/RESULTS.md, "Mixture of experts at real scale")."""
    cfg = mm_config(N, K, dtype)
    if not _INTERPRET and dtype != torch.float32:      # 3 stages of 128-wide tiles pass an H100's shared memory
        cfg.update(BLOCK_N=min(cfg["BLOCK_N"], 128), BLOCK_K=64, num_stages=2)
    return cfg


def grouped_gemm(lhs: torch.Tensor, rhs: torch.Tensor | NF4Rhs, offsets: torch.Tensor, p: torch.Tensor | None = None,
                 q: torch.Tensor | None = None, scale: float = 1.0, config: dict | None = None) -> torch.Tensor:
    """c[rows_g] = lhs[rows_g] · rhs[g] (+ scale · p[rows_g] · q[g]) for lhs (M, K), rhs (G, K, N), p (M, R),
    q (G, R, N), any strides (pass x·Wᵀ as rhs = W.transpose(1, 2)), or rhs an NF4Rhs (dequantised per tile);
    c (M, N) in lhs's dtype, fp32 accumulation (with the rank-r term: (acc/s + p·q)·s, the same as acc + s·(p·q)
    up to fp32 rounding). Rows outside [0, offsets[-1]) are not written. `config`: block sizes etc."""
    M, K = lhs.shape
    G, _, N = rhs.shape
    nf4 = isinstance(rhs, NF4Rhs)
    c = torch.empty(M, N, dtype=lhs.dtype, device=lhs.device)
    cfg = dict(config or (nf4_config if nf4 else mm_config)(N, K, lhs.dtype))
    has_lora = p is not None and scale != 0          # s = 0: the base GEMM alone, exactly
    R = p.shape[1] if has_lora else 0
    r_ = rhs.w.packed if nf4 else rhs
    p_, q_ = (p, q) if has_lora else (c, r_)                     # unused pointers when not has_lora
    p_strides = p.stride() if has_lora else (0, 0)
    q_strides = q.stride() if has_lora else (0, 0, 0)
    if nf4:
        if N * K >= 2**31:
            raise ValueError(f"grouped_gemm: a 4-bit group of {N} × {K} weights is past the kernel's int32 index")
        w = rhs.w
        quant = (w.absmax_codes, w.nested_absmax, w.offset, w.code, w.nested_code, w.absmax_codes.stride(0),
                 w.nested_absmax.stride(0))
    else:
        quant = (c, c, c, c, c, 0, 0)
    grid = ((triton.cdiv(M, cfg["BLOCK_M"]) + G) * triton.cdiv(N, cfg["BLOCK_N"]),)
    # No FMA contraction with NF4: a block's scale rounds its multiply and add apart, as the reference does.
    _grouped_mm_kernel[grid](lhs, r_, c, p_, q_, offsets, M, N, K, R, G, float(scale),
                             *lhs.stride(), *rhs.stride(), *c.stride(), *p_strides, *q_strides, *quant,
                             HAS_LORA=has_lora, NF4=nf4, BLOCK_R=_np2(R, 16, 64),
                             BLOCK_G=max(16, triton.next_power_of_2(G)), **_dot_args(lhs.dtype), **cfg,
                             **({"enable_fp_fusion": False} if nf4 else {}))
    return c


def _wgrad_split(programs: int, M: int, G: int, block_m: int, device: torch.device) -> int:
    """Row splits per (group, tile): enough programs for ~4 per SM, at most 8, ≥ one row block each on average."""
    if WGRAD_SPLIT is not None:
        return WGRAD_SPLIT
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    return max(1, min(8, triton.cdiv(4 * sms, programs), triton.cdiv(M, G * block_m)))


def grouped_wgrad(u: torch.Tensor, v: torch.Tensor, offsets: torch.Tensor, G: int, scale: float = 1.0) -> torch.Tensor:
    """out[g] = scale · u[rows_g]ᵀ · v[rows_g] for u (M, P), v (M, Q), any strides → (G, P, Q) in u's dtype
    (zeros for an empty group); fp32 accumulation, one rounding."""
    (M, P), (_, Q) = u.shape, v.shape
    cfg = wgrad_config(P, Q, u.dtype)
    programs = G * triton.cdiv(P, cfg["BLOCK_P"]) * triton.cdiv(Q, cfg["BLOCK_Q"])
    split = _wgrad_split(programs, M, G, cfg["BLOCK_M"], u.device)
    if split > 1 and split * G * P * Q * 4 > 2**30:          # fp32 partials over 1 GiB: not worth it
        split = 1
    out = torch.empty(split, G, P, Q, dtype=u.dtype if split == 1 else torch.float32, device=u.device)
    _grouped_wgrad_kernel[(programs, split)](u, v, out, offsets, M, P, Q, float(scale), *u.stride(), *v.stride(),
                                             *out.stride(), **_dot_args(u.dtype), **cfg)
    return out[0] if split == 1 else out.sum(0).to(u.dtype)


# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------

class GroupedMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offsets):
        y = grouped_gemm(x, w.transpose(1, 2), offsets)
        ctx.save_for_backward(x if ctx.needs_input_grad[1] else None, w, offsets)     # x only for dW
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, offsets = ctx.saved_tensors
        dx = grouped_gemm(dy, w, offsets) if ctx.needs_input_grad[0] else None
        dw = grouped_wgrad(dy, x, offsets, w.shape[0]) if ctx.needs_input_grad[1] else None
        return dx, dw, None


class GroupedLoRAMMFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, a, b, scale, offsets):
        xa = grouped_gemm(x, a.transpose(1, 2), offsets)                                  # (M, r)
        y = grouped_gemm(x, w.transpose(1, 2), offsets, p=xa, q=b.transpose(1, 2), scale=scale)
        ctx.save_for_backward(x, w, a, b, xa, offsets)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        x, w, a, b, xa, offsets = ctx.saved_tensors
        need_x, need_w, need_a, need_b = ctx.needs_input_grad[:4]
        G, s = w.shape[0], ctx.scale
        dx = dw = da = db = None
        if need_x or need_a:
            dyb = grouped_gemm(dy, b, offsets)                                            # (M, r) = dy Bᵍ
        if need_x:
            dx = grouped_gemm(dy, w, offsets, p=dyb, q=a, scale=s)                        # dy Wᵍ + s·(dy Bᵍ) Aᵍ
        if need_a:
            da = grouped_wgrad(dyb, x, offsets, G, s)
        if need_b:
            db = grouped_wgrad(dy, xa, offsets, G, s)
        if need_w:
            dw = grouped_wgrad(dy, x, offsets, G)
        return dx, dw, da, db, None, None


# How the 4-bit experts reach the GEMM: "tile" dequantises each weight tile in the GEMM's registers (no full-size
# weight ever exists); "stack" dequantises the whole stack into a temporary (one Triton pass, 2 bytes a weight) for the
# bf16 grouped GEMM and frees it, again in the backward. Measured on an H100 (bench/RESULTS.md, "Mixture of experts at
# real scale"): the GLM-4.5-style step with "tile" took 18.7× the bf16 experts' time (per-element scale gathers in
# the tile loop), so "stack" is the default until the tile loop is rewritten.
NF4_EXPERTS = "stack"


def _nf4_rhs(w: NF4Stack, transposed: bool, dtype: torch.dtype):
    if NF4_EXPERTS == "tile":
        return NF4Rhs(w, transposed)
    from glm_lora.kernels.triton_nf4 import dequantize_nf4_stack
    full = dequantize_nf4_stack(w, dtype)
    return full.transpose(1, 2) if transposed else full


class GroupedNF4MMFunction(torch.autograd.Function):
    """x · Wᵍᵀ (+ s · (x Aᵍᵀ) Bᵍᵀ) with W a frozen 4-bit stack (not an autograd input): gradients to x, a, b."""

    @staticmethod
    def forward(ctx, x, a, b, scale, offsets, w):
        lora = a is not None
        xa = grouped_gemm(x, a.transpose(1, 2), offsets) if lora else None
        y = grouped_gemm(x, _nf4_rhs(w, True, x.dtype), offsets, p=xa, q=b.transpose(1, 2) if lora else None,
                         scale=scale)
        ctx.save_for_backward(x if lora else None, a, b, xa, offsets)
        ctx.scale, ctx.w = scale, w
        return y

    @staticmethod
    def backward(ctx, dy):
        x, a, b, xa, offsets = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        G, s = ctx.w.shape[0], ctx.scale
        dyb = grouped_gemm(dy, b, offsets) if a is not None and (need_x or need_a) else None
        dx = grouped_gemm(dy, _nf4_rhs(ctx.w, False, dy.dtype), offsets, p=dyb, q=a, scale=s) if need_x else None
        da = grouped_wgrad(dyb, x, offsets, G, s) if need_a else None
        db = grouped_wgrad(dy, xa, offsets, G, s) if need_b else None
        return dx, da, db, None, None, None


# ---------------------------------------------------------------------------------------------
# Ops
# ---------------------------------------------------------------------------------------------

def _check(x, w, offsets):
    check_grouped(x, w, offsets, values=CHECK_OFFSET_VALUES or offsets.device.type == "cpu")


def _autocast(*tensors):
    """Under autocast: the tensors in the autocast dtype (like F.linear's inputs), else as they are."""
    device_type = tensors[0].device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        return True, [t.to(dtype) for t in tensors]
    return False, list(tensors)


def grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """y[rows_g] = x[rows_g] · w[g]ᵀ: x (M, K) sorted by group, w (G, N, K), offsets (G,) int32 cumulative end
    rows → y (M, N). Gradients: dx, and dw only when w requires grad. Same as `kernels.reference.grouped_mm`."""
    cast, (x, w) = _autocast(x, w)
    _check(x, w, offsets)
    offsets = offsets.contiguous()
    if cast:
        with torch.autocast(x.device.type, enabled=False):
            return GroupedMMFunction.apply(x, w, offsets)
    return GroupedMMFunction.apply(x, w, offsets)


def grouped_lora_mm(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                    offsets: torch.Tensor) -> torch.Tensor:
    """grouped_mm(x, w) + scale · grouped_mm(grouped_mm(x, a), b) with a (G, r, K), b (G, N, r), the rank-r term
    folded into the base GEMM's tiles. Gradients to x, a, b (and w if it requires grad)."""
    cast, (x, w, a, b) = _autocast(x, w, a, b)
    _check(x, w, offsets)
    G, N, K = w.shape
    r = a.shape[1] if a.dim() == 3 else -1
    if a.shape != (G, r, K) or b.shape != (G, N, r) or {a.dtype, b.dtype} != {x.dtype}:
        raise ValueError(f"grouped_lora_mm: a must be (G, r, K) = ({G}, r, {K}) and b (G, N, r) = ({G}, {N}, r) "
                         f"in {x.dtype}, got {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
    offsets = offsets.contiguous()
    if cast:
        with torch.autocast(x.device.type, enabled=False):
            return GroupedLoRAMMFunction.apply(x, w, a, b, float(scale), offsets)
    return GroupedLoRAMMFunction.apply(x, w, a, b, float(scale), offsets)


def grouped_nf4_mm(x: torch.Tensor, w: NF4Stack, offsets: torch.Tensor, a: torch.Tensor | None = None,
                   b: torch.Tensor | None = None, scale: float = 1.0) -> torch.Tensor:
    """`grouped_mm` / `grouped_lora_mm` over a 4-bit stack W (G, N, K) (kernels.reference.NF4Stack), W dequantised as
    `NF4_EXPERTS` says (the stack in one pass, or each tile in registers). Same as `kernels.reference.grouped_nf4_mm`."""
    cast, tensors = _autocast(*(t for t in (x, a, b) if t is not None))
    x, a, b = (tensors + [None, None])[:3]
    G, N, K = w.shape
    if x.dim() != 2 or x.shape[1] != K:
        raise ValueError(f"grouped nf4 mm: x must be (M, {K}) for W {tuple(w.shape)}, got {tuple(x.shape)}")
    check_grouped(x, x.new_empty(G, 0, K), offsets, values=CHECK_OFFSET_VALUES or offsets.device.type == "cpu")
    if a is not None and (a.shape[::2] != (G, K) or b.shape[:2] != (G, N) or {a.dtype, b.dtype} != {x.dtype}):
        raise ValueError(f"grouped nf4 mm: a must be (G, r, K) = ({G}, r, {K}) and b (G, N, r) = ({G}, {N}, r) in "
                         f"{x.dtype}, got {tuple(a.shape)} {a.dtype} and {tuple(b.shape)} {b.dtype}")
    offsets = offsets.contiguous()
    with torch.autocast(x.device.type, enabled=False) if cast else contextlib.nullcontext():
        return GroupedNF4MMFunction.apply(x, a, b, float(scale), offsets, w)


# ---------------------------------------------------------------------------------------------
# torch's grouped GEMM, for comparison
# ---------------------------------------------------------------------------------------------

def torch_grouped_mm_supported(x: torch.Tensor, w: torch.Tensor) -> bool:
    """Where torch._grouped_mm runs its CUTLASS kernel (torch ≥ 2.8, aten/native/cuda/GroupedBlas.cpp): bf16
    operands and output on sm90/sm100, every row stride a multiple of 16 bytes (K, N multiples of 8). Elsewhere
    it falls back to a per-group loop that copies the offsets to the host (or refuses)."""
    return (hasattr(torch, "_grouped_mm") and x.is_cuda and x.dtype == w.dtype == torch.bfloat16
            and torch.cuda.get_device_capability(x.device)[0] in (9, 10)
            and x.shape[1] % 8 == 0 and w.shape[1] % 8 == 0 and x.stride(1) == 1 and x.stride(0) % 8 == 0
            and w.stride(2) == 1 and w.stride(1) % 8 == 0 and w.stride(0) % 8 == 0)


def torch_grouped_mm(x: torch.Tensor, w: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_mm` through torch._grouped_mm(mat_a (M, K), mat_b (G, K, N), offs (G,) int32) with mat_b = a
    transposed view of w (column-major, what its kernel takes without a copy); torch's autograd gives dx, dw.
    Its output's row stride is padded to 16 bytes (same values)."""
    _, (x, w) = _autocast(x, w)
    _check(x, w, offsets)
    return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)


def torch_grouped_lora_mm(x: torch.Tensor, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scale: float,
                          offsets: torch.Tensor) -> torch.Tensor:
    """`grouped_lora_mm` as three torch._grouped_mm calls (r a multiple of 8 for its kernel)."""
    return torch_grouped_mm(x, w, offsets) + scale * torch_grouped_mm(torch_grouped_mm(x, a, offsets), b, offsets)
