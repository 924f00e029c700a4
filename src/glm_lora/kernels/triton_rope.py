"""Fused rotary embedding for q and k in one Triton launch, forward and backward: Llama/Qwen's rotated halves
and GLM's interleaved pairs, over the whole head or its first R dims (partial rotary; the rest pass through).

Same semantics as `kernels.reference.apply_rope`. One program per (batch, position, block of heads) rotates
HEAD_TILE elements of q or of k (one program carrying all of GLM-4-9B's 32 heads of 128 was 3.8x slower). Any
strides are handled in place, so the (B, H, T, D) transposed views of the (B, T, H, D) projections need no
copy. Outputs (and input gradients) are (B, H, T, D) views laid out
as (B, T, H, D): attention's output and gradients follow q/k/v's layout (FlexAttention, SDPA's flash
kernels), so the heads join back into (B, T, H·D) as views on both sides of the step, no copies. The
backward is the transposed rotation: the same kernel with each pair's two sin entries swapped and negated.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotate_heads(
    X, O, sx_h, sx_d, so_h, so_d, n_heads, rotary, head_dim, d1, d2, pair_mask,
    c1, c2, s1, s2,
    BLOCK_H: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    h = tl.arange(0, BLOCK_H)[:, None]
    mask = (h < n_heads) & pair_mask[None, :]
    x1 = tl.load(X + h * sx_h + d1[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + h * sx_h + d2[None, :] * sx_d, mask=mask, other=0.0).to(tl.float32)
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    tl.store(O + h * so_h + d1[None, :] * so_d, o1.to(O.dtype.element_ty), mask=mask)
    tl.store(O + h * so_h + d2[None, :] * so_d, o2.to(O.dtype.element_ty), mask=mask)
    if BLOCK_PASS > 0:      # partial rotary: the dims past `rotary` pass through (values and gradients alike)
        p = rotary + tl.arange(0, BLOCK_PASS)[None, :]
        pass_mask = (h < n_heads) & (p < head_dim)
        tl.store(O + h * so_h + p * so_d, tl.load(X + h * sx_h + p * sx_d, mask=pass_mask), mask=pass_mask)


@triton.jit
def _rotate_heads_interleaved(
    X, O, sx_h, sx_d, so_h, so_d, n_heads, half, head_dim, c1, c2, s1, s2,
    BLOCK_H: tl.constexpr, BLOCK_P: tl.constexpr,
):
    """GLM's pairs (2j, 2j + 1): each head's row is loaded and stored whole, contiguous, and split into its pairs
    in registers (loading the even and odd dims apart read every other element twice over). Pairs past `half`
    (partial rotary) pass through as loaded."""
    h = tl.arange(0, BLOCK_H)[:, None, None]
    j = tl.arange(0, BLOCK_P)[None, :, None]
    d = 2 * j + tl.arange(0, 2)[None, None, :]
    mask = (h < n_heads) & (d < head_dim)
    x = tl.load(X + h * sx_h + d * sx_d, mask=mask, other=0.0)
    x1, x2 = tl.split(x.to(tl.float32))
    o1 = x1 * c1[None, :] - x2 * s1[None, :]
    o2 = x2 * c2[None, :] + x1 * s2[None, :]
    rotated = tl.join(o1, o2).to(O.dtype.element_ty)
    tl.store(O + h * so_h + d * so_d, tl.where(j < half, rotated, x), mask=mask)


@triton.jit
def _rope_kernel(
    Q, K, QO, KO, COS, SIN,
    sq_b, sq_h, sq_t, sq_d,
    sk_b, sk_h, sk_t, sk_d,
    sqo_b, sqo_h, sqo_t, sqo_d,
    sko_b, sko_h, sko_t, sko_d,
    scos_b, scos_t, ssin_b, ssin_t,
    T, n_q_heads, n_k_heads, half, head_dim,
    BACKWARD: tl.constexpr, INTERLEAVED: tl.constexpr, BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_PASS: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    b = pid // T
    t = pid % T
    # the second grid axis: q's blocks of BLOCK_QH heads, then k's of BLOCK_KH
    block = tl.program_id(1)
    q_blocks = tl.cdiv(n_q_heads, BLOCK_QH)
    is_q = block < q_blocks
    if is_q:
        h0 = block * BLOCK_QH
        X, O, sx_b, sx_h, sx_t, sx_d = Q, QO, sq_b, sq_h, sq_t, sq_d
        so_b, so_h, so_t, so_d, n_heads = sqo_b, sqo_h, sqo_t, sqo_d, n_q_heads - h0
    else:
        h0 = (block - q_blocks) * BLOCK_KH
        X, O, sx_b, sx_h, sx_t, sx_d = K, KO, sk_b, sk_h, sk_t, sk_d
        so_b, so_h, so_t, so_d, n_heads = sko_b, sko_h, sko_t, sko_d, n_k_heads - h0
    X += b * sx_b + t * sx_t + h0 * sx_h
    O += b * so_b + t * so_t + h0 * so_h
    i = tl.arange(0, BLOCK_D)       # one pair of rotated dims each: (2i, 2i + 1) interleaved, (i, i + half) halves
    pair_mask = i < half
    if INTERLEAVED:                 # (BLOCK_D covers every pair of the head: the rows are rotated whole)
        d1 = 2 * i
        d2 = d1 + 1
    else:
        d1 = i
        d2 = i + half
    cos = COS + b * scos_b + t * scos_t
    sin = SIN + b * ssin_b + t * ssin_t
    # The reference casts the tables to q's dtype before multiplying: do the same rounding.
    dtype = QO.dtype.element_ty
    c1 = tl.load(cos + d1, mask=pair_mask, other=0.0).to(tl.float32).to(dtype).to(tl.float32)
    c2 = tl.load(cos + d2, mask=pair_mask, other=0.0).to(tl.float32).to(dtype).to(tl.float32)
    s1 = tl.load(sin + d1, mask=pair_mask, other=0.0).to(tl.float32).to(dtype).to(tl.float32)
    s2 = tl.load(sin + d2, mask=pair_mask, other=0.0).to(tl.float32).to(dtype).to(tl.float32)
    if BACKWARD:
        s1_fwd = s1
        s1 = -s2
        s2 = -s1_fwd
    if INTERLEAVED:
        if is_q:
            _rotate_heads_interleaved(X, O, sx_h, sx_d, so_h, so_d, n_heads, half, head_dim, c1, c2, s1, s2,
                                      BLOCK_QH, BLOCK_D)
        else:
            _rotate_heads_interleaved(X, O, sx_h, sx_d, so_h, so_d, n_heads, half, head_dim, c1, c2, s1, s2,
                                      BLOCK_KH, BLOCK_D)
    else:
        if is_q:
            _rotate_heads(X, O, sx_h, sx_d, so_h, so_d, n_heads, 2 * half, head_dim, d1, d2, pair_mask,
                          c1, c2, s1, s2, BLOCK_QH, BLOCK_PASS)
        else:
            _rotate_heads(X, O, sx_h, sx_d, so_h, so_d, n_heads, 2 * half, head_dim, d1, d2, pair_mask,
                          c1, c2, s1, s2, BLOCK_KH, BLOCK_PASS)


def _heads_last_empty(x: torch.Tensor) -> torch.Tensor:
    B, H, T, D = x.shape
    return x.new_empty(B, T, H, D).transpose(1, 2)


HEAD_TILE = 1024    # q or k elements (heads × head_dim) one program rotates


def _rope(q, k, cos, sin, interleaved, backward):
    B, H, T, D = q.shape
    Hkv, R = k.shape[1], cos.shape[-1]
    qo, ko = _heads_last_empty(q), _heads_last_empty(k)
    heads = max(1, HEAD_TILE // triton.next_power_of_2(D))
    block_qh, block_kh = min(triton.next_power_of_2(H), heads), min(triton.next_power_of_2(Hkv), heads)
    grid = (B * T, triton.cdiv(H, block_qh) + triton.cdiv(Hkv, block_kh))
    _rope_kernel[grid](
        q, k, qo, ko, cos, sin,
        *q.stride(), *k.stride(), *qo.stride(), *ko.stride(),
        cos.stride(0), cos.stride(1), sin.stride(0), sin.stride(1),
        T, H, Hkv, R // 2, D,
        BACKWARD=backward, INTERLEAVED=interleaved, BLOCK_QH=block_qh, BLOCK_KH=block_kh,
        BLOCK_D=triton.next_power_of_2(triton.cdiv(D, 2) if interleaved else R // 2),
        BLOCK_PASS=triton.next_power_of_2(D - R) if D > R and not interleaved else 0, num_warps=4,
    )
    return qo, ko


class RoPEFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, cos, sin, interleaved):
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved
        return _rope(q, k, cos, sin, interleaved, backward=False)

    @staticmethod
    def backward(ctx, dq, dk):
        cos, sin = ctx.saved_tensors
        dq, dk = _rope(dq, dk, cos, sin, ctx.interleaved, backward=True)
        return dq, dk, None, None, None


def apply_rope(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """q, k: (B, H, T, D) (k may have fewer heads); cos, sin: (B, T, R) or (1, T, R) with R ≤ D even: the
    first R dims of each head rotate, the rest pass through (partial rotary, GLM). `interleaved`: rotate
    pairs (GLM), not halves (Llama/Qwen). cos/sin get no gradient."""
    B, H, T, D = q.shape
    R = cos.shape[-1]
    if (k.dim() != 4 or (k.shape[0], k.shape[2], k.shape[3]) != (B, T, D) or k.dtype != q.dtype
            or R % 2 or not 0 < R <= D or sin.shape[-1] != R):
        raise ValueError(f"apply_rope: q {tuple(q.shape)} {q.dtype} / k {tuple(k.shape)} {k.dtype} / tables "
                         f"{tuple(cos.shape)} need matching B, T, D and dtype, and an even table width ≤ D")
    cos, sin = (t.expand(B, T, R) for t in (cos, sin))
    cos, sin = (t if t.stride(-1) == 1 else t.contiguous() for t in (cos, sin))
    return RoPEFunction.apply(q, k, cos, sin, interleaved)
