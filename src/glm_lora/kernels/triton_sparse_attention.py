"""DeepSeek sparse attention (DSA, GLM-5) in Triton: attention over the keys the indexer listed, forward and backward.

Semantics (those of `kernels.reference.sparse_attention`, transformers' masked-dense form): q (B, Hq, T, Dk),
k (B, Hkv, T, Dk), v (B, Hkv, T, Dv), Hq a multiple of Hkv (query head h reads kv head h // (Hq / Hkv); Hkv = 1 is
absorbed MLA, one latent key per position shared by every head); index (B, T, K) the key positions each query
attends to, shared by all heads, distinct, -1 = no key (padding, anywhere in the row); each query lists at least one
key (one listing none gets a zero output and zero gradients, where the reference gives NaN). Output
(B, Hq, T, Dv) = softmax(scale · q kᵀ over the listed keys) · v, in q's dtype. Which keys a query lists, and so
how ties among the indexer's equal scores were broken, is the caller's (`reference.index_topk`: torch.topk's
choice); this op only reads `index`, and the order of its entries does not matter.

Memory is O(T·K): no T × T score or mask exists. Forward keeps the per-(query, head) log-sum-exp (B, Hq, T) fp32
for backward, which recomputes the probabilities.

Forward, one program per (query t, batch, kv head, block of BLOCK_H query heads of that kv head): loop over the
query's K indices BLOCK_K at a time, gather those key and value rows, and run the online softmax (FlashAttention-2,
Dao 2023) on the (BLOCK_H × BLOCK_K) scores. The heads of the block share the gathered rows, so they are the M
dimension of the tensor-core dots: with Hkv = 1 and 16–64 heads, (BLOCK_H × Dk) · (Dk × BLOCK_K) per block of keys,
the rows read once for all of them. tl.dot needs every dimension ≥ 16 and a power of two, so the head block is padded
(masked rows) to ≥ 16, and Dk is split into a power-of-two part and a padded remainder, two dots (576 = 512 + 64,
the latent and its RoPE tail as DeepSeek's TileLang sparse MLA kernels split it; 192 = 128 + 64) instead of one
padded to 1024. With 16 or 32 heads a program Triton lowers the dots to mma.sync, not Hopper's wgmma (M ≥ 64): 64
heads × Dv 512 of fp32 accumulator spilled registers; the gathers, not the dots, are expected to bound the time.

Backward, the same programs: recompute p = exp(s − lse), dp = dO vᵀ, ds = p ⊙ (dp − rowsum(dO ⊙ O)), write
dq = scale · ds k for the program's own rows, and add dv = pᵀ dO and dk = scale · dsᵀ q into fp32 buffers
(B, Hkv, T, D) with atomics, BLOCK_C columns at a time (whole tiles spilled registers): a key's gradient sums over
every query that listed it, and which queries those are is known only from `index`. The inverse lists (key →
queries, a sort of T·K entries) would let programs own keys, but each would then gather queries, H rows per
(query, key) pair against the 1 key row gathered here; DeepSeek's TileLang sparse MLA backward also accumulates dKV
with fp32 atomics. Atomics make dk and dv run-to-run nondeterministic in their last bits (the summation order
varies); dq and the forward are deterministic.

Every dot accumulates in fp32; p and ds are rounded to the inputs' dtype before their dots (as FlashAttention).
Inputs bf16/fp16/fp32 on the GPU (fp32 dots exact, "ieee"); under TRITON_INTERPRET=1 fp32/fp16 (bf16 there is
upcast after each load: the interpreter's bf16 dot is wrong).
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from glm_lora.kernels.reference import check_sparse_attention

_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"   # jit functions bind to the interpreter at import
LOG2E = 1.4426950408889634


@triton.jit
def _load_tile(base, rows, stride, keep, d0, D, BLOCK_D: tl.constexpr, UPCAST: tl.constexpr):
    """(len(rows), BLOCK_D) tile of columns d0.. of the given rows (gathered keys / values, or one query's heads),
    zeros where a row is not kept or a column is past D."""
    cols = d0 + tl.arange(0, BLOCK_D)
    t = tl.load(base + rows[:, None] * stride + cols[None, :], mask=keep[:, None] & (cols[None, :] < D), other=0.0)
    if UPCAST:
        t = t.to(tl.float32)
    return t


@triton.jit
def _program(HKV, HB, G, BLOCK_H: tl.constexpr):
    """This program's (query, batch, kv head, its query heads, which of them exist)."""
    t = tl.program_id(0)
    pid = tl.program_id(1)
    hb, bh = pid % HB, pid // HB
    b, hk = bh // HKV, bh % HKV
    in_group = hb * BLOCK_H + tl.arange(0, BLOCK_H)
    return t, b, hk.to(tl.int64), (hk * G + in_group).to(tl.int64), in_group < G


@triton.jit
def _fwd_kernel(Q, K, V, IDX, O, LSE,
                s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_oh, s_ot, s_lb, s_lh,
                T, NK, HKV, HB, G, DK, DV, qk_scale,
                BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                BLOCK_DV: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    t, b, hk, heads, in_h = _program(HKV, HB, G, BLOCK_H)
    q_base = Q + b.to(tl.int64) * s_qb + t.to(tl.int64) * s_qt
    qa = _load_tile(q_base, heads, s_qh, in_h, 0, DK, DA, UPCAST)
    if DB > 0:
        qb = _load_tile(q_base, heads, s_qh, in_h, DA, DK, DB, UPCAST)
    k_base = K + b.to(tl.int64) * s_kb + hk * s_kh
    v_base = V + b.to(tl.int64) * s_vb + hk * s_vh
    idx_base = IDX + (b.to(tl.int64) * T + t) * NK

    m_i = tl.full((BLOCK_H,), float("-inf"), tl.float32)     # running max of the scaled scores (log2 units)
    l_i = tl.zeros((BLOCK_H,), tl.float32)                    # running sum of exp2(score - m_i)
    acc = tl.zeros((BLOCK_H, BLOCK_DV), tl.float32)
    for k0 in range(0, NK, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        pos = tl.load(idx_base + kk, mask=kk < NK, other=-1)
        valid = pos >= 0
        rows = tl.where(valid, pos, 0).to(tl.int64)
        s = tl.dot(qa, tl.trans(_load_tile(k_base, rows, s_kt, valid, 0, DK, DA, UPCAST)),
                   input_precision=DOT_PRECISION)
        if DB > 0:
            s = tl.dot(qb, tl.trans(_load_tile(k_base, rows, s_kt, valid, DA, DK, DB, UPCAST)), s,
                       input_precision=DOT_PRECISION)
        s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        # a block of padding only, before any valid key: keep exp2 away from (-inf) - (-inf)
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.math.exp2(s - m_ref[:, None])
        alpha = tl.math.exp2(m_i - m_ref)
        l_i = l_i * alpha + tl.sum(p, 1)
        vt = _load_tile(v_base, rows, s_vt, valid, 0, DV, BLOCK_DV, UPCAST)
        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None]
    cols = tl.arange(0, BLOCK_DV)
    o_ptr = O + b.to(tl.int64) * s_ob + t.to(tl.int64) * s_ot + heads[:, None] * s_oh + cols[None, :]
    tl.store(o_ptr, out.to(O.dtype.element_ty), mask=in_h[:, None] & (cols[None, :] < DV))
    # +inf for a query with no key: backward's exp2(s - lse) is then 0, no NaN
    lse = tl.where(has_keys, m_i + tl.math.log2(tl.where(has_keys, l_i, 1.0)), float("inf"))
    tl.store(LSE + b.to(tl.int64) * s_lb + heads * s_lh + t, lse, mask=in_h)


@triton.jit
def _bwd_kernel(Q, K, V, IDX, O, DO, LSE, DQ, DKB, DVB,
                s_qb, s_qh, s_qt, s_kb, s_kh, s_kt, s_vb, s_vh, s_vt, s_ob, s_oh, s_ot,
                s_dob, s_doh, s_dot, s_lb, s_lh, s_dqb, s_dqh, s_dqt, s_gkb, s_gkh, s_gkt, s_gvb, s_gvh, s_gvt,
                T, NK, HKV, HB, G, DK, DV, scale, qk_scale,
                BLOCK_H: tl.constexpr, BLOCK_K: tl.constexpr, DA: tl.constexpr, DB: tl.constexpr,
                BLOCK_DV: tl.constexpr, BLOCK_C: tl.constexpr, UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr):
    t, b, hk, heads, in_h = _program(HKV, HB, G, BLOCK_H)
    q_base = Q + b.to(tl.int64) * s_qb + t.to(tl.int64) * s_qt
    qa = _load_tile(q_base, heads, s_qh, in_h, 0, DK, DA, UPCAST)
    dqa = tl.zeros((BLOCK_H, DA), tl.float32)
    if DB > 0:
        qb = _load_tile(q_base, heads, s_qh, in_h, DA, DK, DB, UPCAST)
        dqb = tl.zeros((BLOCK_H, DB), tl.float32)
    do_base = DO + b.to(tl.int64) * s_dob + t.to(tl.int64) * s_dot
    do = _load_tile(do_base, heads, s_doh, in_h, 0, DV, BLOCK_DV, UPCAST)
    o = _load_tile(O + b.to(tl.int64) * s_ob + t.to(tl.int64) * s_ot, heads, s_oh, in_h, 0, DV, BLOCK_DV, UPCAST)
    delta = tl.sum(do.to(tl.float32) * o.to(tl.float32), 1)                   # rowsum(dO ⊙ O)
    lse = tl.load(LSE + b.to(tl.int64) * s_lb + heads * s_lh + t, mask=in_h, other=float("inf"))

    k_base = K + b.to(tl.int64) * s_kb + hk * s_kh
    v_base = V + b.to(tl.int64) * s_vb + hk * s_vh
    gk_base = DKB + b.to(tl.int64) * s_gkb + hk * s_gkh
    gv_base = DVB + b.to(tl.int64) * s_gvb + hk * s_gvh
    idx_base = IDX + (b.to(tl.int64) * T + t) * NK
    ca, cc = tl.arange(0, DA), tl.arange(0, BLOCK_C)
    for k0 in range(0, NK, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        pos = tl.load(idx_base + kk, mask=kk < NK, other=-1)
        valid = pos >= 0
        rows = tl.where(valid, pos, 0).to(tl.int64)
        ka = _load_tile(k_base, rows, s_kt, valid, 0, DK, DA, UPCAST)
        s = tl.dot(qa, tl.trans(ka), input_precision=DOT_PRECISION)
        if DB > 0:
            kb = _load_tile(k_base, rows, s_kt, valid, DA, DK, DB, UPCAST)
            s = tl.dot(qb, tl.trans(kb), s, input_precision=DOT_PRECISION)
        p = tl.where(valid[None, :], tl.math.exp2(s * qk_scale - lse[:, None]), 0.0)
        vt = _load_tile(v_base, rows, s_vt, valid, 0, DV, BLOCK_DV, UPCAST)
        dp = tl.dot(do, tl.trans(vt), input_precision=DOT_PRECISION)
        ds = (p * (dp - delta[:, None])).to(qa.dtype)                         # d loss / d (q·k), before scale
        dqa = tl.dot(ds, ka, dqa, input_precision=DOT_PRECISION)
        if DB > 0:
            dqb = tl.dot(ds, kb, dqb, input_precision=DOT_PRECISION)
        # dv = pᵀ dO and dk = scale · dsᵀ q go out BLOCK_C columns at a time, the dO / q columns re-read (L1 hits):
        # whole (BLOCK_K × D) fp32 tiles and their atomics' addresses spilled registers at D = 512 / 576.
        # The block's keys are distinct, so only other programs (queries, head blocks) add to the same rows.
        pt, dst = tl.trans(p.to(do.dtype)), tl.trans(ds)
        for c0 in range(0, DV, BLOCK_C):
            dv = tl.dot(pt, _load_tile(do_base, heads, s_doh, in_h, c0, DV, BLOCK_C, UPCAST),
                        input_precision=DOT_PRECISION)
            tl.atomic_add(gv_base + rows[:, None] * s_gvt + (c0 + cc)[None, :], dv,
                          mask=valid[:, None] & (c0 + cc < DV)[None, :], sem="relaxed")
        for c0 in range(0, DK, BLOCK_C):
            dk = tl.dot(dst, _load_tile(q_base, heads, s_qh, in_h, c0, DK, BLOCK_C, UPCAST),
                        input_precision=DOT_PRECISION) * scale
            tl.atomic_add(gk_base + rows[:, None] * s_gkt + (c0 + cc)[None, :], dk,
                          mask=valid[:, None] & (c0 + cc < DK)[None, :], sem="relaxed")

    dq_base = DQ + b.to(tl.int64) * s_dqb + t.to(tl.int64) * s_dqt + heads[:, None] * s_dqh
    tl.store(dq_base + ca[None, :], (dqa * scale).to(DQ.dtype.element_ty), mask=in_h[:, None] & (ca[None, :] < DK))
    if DB > 0:
        cb = DA + tl.arange(0, DB)
        tl.store(dq_base + cb[None, :], (dqb * scale).to(DQ.dtype.element_ty),
                 mask=in_h[:, None] & (cb[None, :] < DK))


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

def split_dk(dk: int) -> tuple[int, int]:
    """Dk as (DA, DB): a power of two ≥ 16 and a padded power-of-two remainder (0: none), each a tl.dot K dim.
    576 → (512, 64), 256 → (256, 0), 192 → (128, 64), 37 → (32, 16), 8 → (16, 0)."""
    da = max(16, 1 << (dk.bit_length() - 1))
    rest = dk - da
    return da, (0 if rest <= 0 else max(16, triton.next_power_of_2(rest)))


def config(group: int, dk: int, dv: int, backward: bool) -> dict:
    """Block sizes and warps, hand-set (not timed on a GPU yet) from what ptxas reports for sm_90, bf16 (compiled without
    a GPU by Triton 3.9; the GPU machines run 3.6):
    the largest blocks that compile without register spills, or nearly. BLOCK_H heads of a kv head per program
    (≥ 16: tl.dot's M; 32 past 16 heads, which spilled at 64 with Dv = 512); BLOCK_K keys per step; backward writes
    dk / dv BLOCK_C columns at a time. At Dk 576 / Dv 512: forward 168 registers a thread (16 heads) and 210 (32),
    backward 185 (16 heads; 32 heads spill 56 bytes, taken for half the atomics). The interpreter pays per program
    and per op: small blocks there, BLOCK_C 16 so that the column loop runs more than once."""
    da, db = split_dk(dk)
    block_dv = max(16, triton.next_power_of_2(dv))
    width = max(da + db, block_dv)
    if _INTERPRET:
        return dict(BLOCK_H=16, BLOCK_K=16, DA=da, DB=db, BLOCK_DV=block_dv, **({"BLOCK_C": 16} if backward else {}))
    cfg = dict(BLOCK_H=16 if group <= 16 else 32, DA=da, DB=db, BLOCK_DV=block_dv,
               num_warps=8 if width > 128 else 4, num_stages=2)
    if backward:
        return dict(cfg, BLOCK_K=16 if width > 256 else 32, BLOCK_C=64 if width > 128 else 32)
    return dict(cfg, BLOCK_K=32 if width > 256 else 64)


def _dot_args(dtype: torch.dtype) -> dict:
    # fp32 inputs keep full precision (no tf32); half inputs are exact in any mode
    return dict(UPCAST=_INTERPRET and dtype == torch.bfloat16, DOT_PRECISION="ieee" if dtype == torch.float32 else "tf32")


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _heads_last(B: int, H: int, T: int, D: int, like: torch.Tensor) -> torch.Tensor:
    """(B, H, T, D) view of (B, T, H, D) memory: a query's heads are one contiguous block (one coalesced store per
    program), and the attention output joins into (B, T, H·D) for the output projection without a copy."""
    return torch.empty(B, T, H, D, dtype=like.dtype, device=like.device).transpose(1, 2)


def _grid(B: int, Hkv: int, T: int, group: int, block_h: int) -> tuple[tuple[int, int], int]:
    hb = triton.cdiv(group, block_h)
    return (T, B * Hkv * hb), hb     # queries on axis 0: up to 2³¹ there, axis 1 caps at 65535


def _forward(q, k, v, index, scale):
    (B, Hq, T, Dk), Hkv, Dv, NK = q.shape, k.shape[1], v.shape[-1], index.shape[-1]
    group = Hq // Hkv
    cfg = config(group, Dk, Dv, backward=False)
    o = _heads_last(B, Hq, T, Dv, q)
    lse = torch.empty(B, Hq, T, dtype=torch.float32, device=q.device)
    grid, hb = _grid(B, Hkv, T, group, cfg["BLOCK_H"])
    _fwd_kernel[grid](q, k, v, index, o, lse,
                      q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                      v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
                      lse.stride(0), lse.stride(1),
                      T, NK, Hkv, hb, group, Dk, Dv, scale * LOG2E, **cfg, **_dot_args(q.dtype))
    return o, lse


def _backward(q, k, v, index, o, lse, do, scale):
    (B, Hq, T, Dk), Hkv, Dv, NK = q.shape, k.shape[1], v.shape[-1], index.shape[-1]
    group = Hq // Hkv
    cfg = config(group, Dk, Dv, backward=True)
    dq = _heads_last(B, Hq, T, Dk, q)
    # fp32 sums over every query that listed a key: O(T·D), rounded to k's / v's dtype once at the end
    dk_acc = torch.zeros(B, Hkv, T, Dk, dtype=torch.float32, device=q.device)
    dv_acc = torch.zeros(B, Hkv, T, Dv, dtype=torch.float32, device=q.device)
    grid, hb = _grid(B, Hkv, T, group, cfg["BLOCK_H"])
    _bwd_kernel[grid](q, k, v, index, o, do, lse, dq, dk_acc, dv_acc,
                      q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
                      v.stride(0), v.stride(1), v.stride(2), o.stride(0), o.stride(1), o.stride(2),
                      do.stride(0), do.stride(1), do.stride(2), lse.stride(0), lse.stride(1),
                      dq.stride(0), dq.stride(1), dq.stride(2), dk_acc.stride(0), dk_acc.stride(1), dk_acc.stride(2),
                      dv_acc.stride(0), dv_acc.stride(1), dv_acc.stride(2),
                      T, NK, Hkv, hb, group, Dk, Dv, scale, scale * LOG2E, **cfg, **_dot_args(q.dtype))
    return dq, dk_acc.to(k.dtype), dv_acc.to(v.dtype)


class SparseAttentionFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, index, scale):
        q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
        index = index.to(torch.int32).contiguous()      # B·T·K < 2³¹ entries: int32 offsets, half the reads
        o, lse = _forward(q, k, v, index, scale)
        ctx.save_for_backward(q, k, v, index, o, lse)
        ctx.scale = scale
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, index, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(q, k, v, index, o, lse, _last_dim_contiguous(do), ctx.scale)
        need = ctx.needs_input_grad
        return dq if need[0] else None, dk if need[1] else None, dv if need[2] else None, None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: torch.Tensor,
                     scale: float) -> torch.Tensor:
    """softmax(scale · q kᵀ over each query's listed keys) · v, (B, Hq, T, Dv) in q's dtype (module docstring),
    laid out heads-last ((B, T, Hq, Dv) memory; dq likewise). q, k, v share one dtype and device, any strides with a
    contiguous last dim (else copied); index (B, T, K) integers on that device, each entry -1 or in [0, T) (not
    checked: reading them would cost a host sync on CUDA)."""
    check_sparse_attention(q, k, v, index)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise ValueError(f"sparse_attention: q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if index.device != q.device:
        raise ValueError(f"sparse_attention: index on {index.device}, q on {q.device}")
    if index.numel() >= 2 ** 31:
        raise ValueError(f"sparse_attention: index has {index.numel()} entries, int32 offsets need < 2³¹")
    return SparseAttentionFunction.apply(q, k, v, index, float(scale))
