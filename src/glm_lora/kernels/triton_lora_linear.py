"""Fused LoRA linear, y = x Wᵀ + scale · dropout(x) Aᵀ Bᵀ, with the base weight W frozen.

Same semantics as `kernels.reference.lora_linear` except that W must not require grad (dW is
never computed: a ValueError says so). The heavy GEMMs stay on cuBLAS and accumulate into one
buffer: the rank-r product is written first and the base GEMM adds itself onto it in its epilogue
(beta=1), in forward (y) and backward (dx), so no separate M×out LoRA tensor exists. Saved for
backward: x, xa = dropout(x) Aᵀ (M×r) and, with dropout, a 1-bit-per-element keep mask.

Dropout runs in Triton: the keep mask is drawn from Philox while the down-projection streams x,
packed to bits, and read back by the backward kernels (dA and the LoRA part of dx), so x⊙mask is
never materialised. The mask is a pure function of a seed drawn from torch's RNG (`dropout_seed`)
and is rebuilt bit-exactly in torch by `dropout_mask`, which is also the CPU fallback.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from glm_lora.kernels.reference import scaled_mm
from glm_lora.kernels.triton_lora_gemm import MAX_RANK, lora_gemm

# jit functions are bound to the interpreter at import time, so decide once, here.
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
BLOCK_M, BLOCK_K = 64, 64           # BLOCK_K: a multiple of 32 (one int32 mask word per 32 columns)

# Philox4x32-10 constants, as in triton.language.random.
_ROUND_A, _ROUND_B = 0xD2511F53, 0xCD9E8D57
_KEY_A, _KEY_B = 0x9E3779B9, 0xBB67AE85
_U32 = 0xFFFFFFFF
_UNIFORM_SCALE = 4.6566127342e-10


# ---------------------------------------------------------------------------------------------
# The dropout mask, in torch (the specification and the CPU path)
# ---------------------------------------------------------------------------------------------

def dropout_seed(device: torch.device | str) -> torch.Tensor:
    """A 1-element int64 seed drawn from torch's RNG on `device` (no host sync on CUDA)."""
    return torch.randint(2**62, (1,), device=device, dtype=torch.int64)


def _mul_hi_lo(a: int, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """High and low 32 bits of a·b for a uint32 constant and uint32 values held in int64."""
    p_lo, p_hi = a * (b & 0xFFFF), a * (b >> 16)           # < 2**48: no int64 overflow
    return (p_hi + (p_lo >> 16)) >> 16, (((p_hi & 0xFFFF) << 16) + p_lo) & _U32


def dropout_mask(seed: torch.Tensor, rows: int, cols: int, p: float) -> torch.Tensor:
    """The (rows, cols) bool keep mask the kernels use for `seed` (from `dropout_seed`) and p.

    Element (m, k) is kept when u >= p, u being output k % 4 of Philox4x32-10 at counter
    m·⌈cols/4⌉ + k // 4 (key = the seed's low and high 32 bits) mapped to [0, 1) like tl.rand:
    exactly what `tl.rand4x(seed, counter)` returns.
    """
    quads = triton.cdiv(cols, 4)
    c0 = torch.arange(rows * quads, device=seed.device, dtype=torch.int64)
    c1 = c2 = c3 = torch.zeros_like(c0)
    s = seed.reshape(()).to(torch.int64)
    k0, k1 = s & _U32, (s >> 32) & _U32
    for _ in range(10):
        hi_b, lo_b = _mul_hi_lo(_ROUND_B, c2)
        hi_a, lo_a = _mul_hi_lo(_ROUND_A, c0)
        c0, c1, c2, c3 = hi_b ^ c1 ^ k0, lo_b, hi_a ^ c3 ^ k1, lo_a
        k0, k1 = (k0 + _KEY_A) & _U32, (k1 + _KEY_B) & _U32
    r = torch.stack((c0, c1, c2, c3), dim=-1).reshape(rows, quads * 4)[:, :cols]
    r = torch.where(r > 0x7FFFFFFF, _U32 - r, r)           # int32 view x < 0 → ~x, as tl.rand does
    u = r.to(torch.float32) * torch.tensor(_UNIFORM_SCALE, dtype=torch.float32)
    return u >= torch.tensor(p, dtype=torch.float32)


def _pack_bits(keep: torch.Tensor) -> torch.Tensor:
    """(rows, cols) bool → (rows, ⌈cols/32⌉) int32, column k in bit k % 32 of word k // 32."""
    rows, cols = keep.shape
    words = triton.cdiv(cols, 32)
    padded = torch.zeros(rows, words * 32, dtype=torch.int64, device=keep.device)
    padded[:, :cols] = keep
    shifts = torch.arange(32, device=keep.device, dtype=torch.int64)
    packed = (padded.view(rows, words, 32) << shifts).sum(-1)
    return torch.where(packed > 0x7FFFFFFF, packed - 2**32, packed).to(torch.int32)


def _unpack_bits(bits: torch.Tensor, cols: int) -> torch.Tensor:
    shifts = torch.arange(32, device=bits.device, dtype=torch.int32)
    return ((bits[..., None] >> shifts) & 1).flatten(-2)[:, :cols].bool()


# ---------------------------------------------------------------------------------------------
# Triton kernels
# ---------------------------------------------------------------------------------------------

@triton.jit
def _keep_tile(seed, offs_m, k0, K, p, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    """Keep mask of rows offs_m × columns k0..k0+BLOCK_K (k0 a multiple of 4), as `dropout_mask`."""
    quads = k0 // 4 + tl.arange(0, BLOCK_K // 4)
    counter = offs_m[:, None] * ((K + 3) // 4) + quads[None, :]
    u0, u1, u2, u3 = tl.rand4x(seed, counter)
    # Interleave so that column 4q + j takes output j of counter q.
    u = tl.reshape(tl.join(tl.join(u0, u2), tl.join(u1, u3)), (BLOCK_M, BLOCK_K))
    return u >= p


@triton.jit
def _pack_tile(keep, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    bits = tl.reshape(keep.to(tl.int32), (BLOCK_M, BLOCK_K // 32, 32))
    return tl.sum(bits << tl.arange(0, 32)[None, None, :], axis=2)   # distinct bits: sum == or


@triton.jit
def _load_keep_tile(bits_ptr, offs_m, mask_m, k0, K, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr):
    n_words = (K + 31) // 32
    offs_w = k0 // 32 + tl.arange(0, BLOCK_K // 32)
    words = tl.load(bits_ptr + offs_m[:, None].to(tl.int64) * n_words + offs_w[None, :],
                    mask=mask_m[:, None] & (offs_w[None, :] < n_words), other=0)
    bits = (words[:, :, None] >> tl.arange(0, 32)[None, None, :]) & 1
    return tl.reshape(bits, (BLOCK_M, BLOCK_K)) != 0


@triton.jit
def _down_kernel(x_ptr, a_ptr, xa_ptr, bits_ptr, seed_ptr, M, K, R, stride_xm, p, inv_keep,
                 HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
                 BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """xa = (x ⊙ keep) Aᵀ / (1 - p) for one block of rows; writes the packed keep mask."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m, mask_r = offs_m < M, offs_r < R
    rows = offs_m[:, None].to(tl.int64)
    n_words = (K + 31) // 32
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    if HAS_DROPOUT:
        seed = tl.load(seed_ptr)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + rows * stride_xm + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :],
                    other=0.0).to(tl.float32)
        if HAS_DROPOUT:
            keep = _keep_tile(seed, offs_m, k0, K, p, BLOCK_M, BLOCK_K) & mask_k[None, :]
            x = tl.where(keep, x, 0.0)
            offs_w = k0 // 32 + tl.arange(0, BLOCK_K // 32)
            tl.store(bits_ptr + rows * n_words + offs_w[None, :], _pack_tile(keep, BLOCK_M, BLOCK_K),
                     mask=mask_m[:, None] & (offs_w[None, :] < n_words))
        a_t = tl.load(a_ptr + offs_r[None, :] * K + offs_k[:, None], mask=mask_k[:, None] & mask_r[None, :],
                      other=0.0).to(tl.float32)
        acc += tl.dot(x, a_t, input_precision=DOT_PRECISION)
    if HAS_DROPOUT:
        acc = acc * inv_keep    # after the dot: the products stay exact
    tl.store(xa_ptr + offs_m[:, None] * R + offs_r[None, :], acc.to(xa_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_r[None, :])


@triton.jit
def _grad_a_kernel(dxa_ptr, x_ptr, bits_ptr, part_ptr, M, K, R, stride_xm, rows_per_split,
                   DOT_PRECISION: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """part[s] = dxaᵀ (x ⊙ keep) over the s-th slice of rows, for one block of columns."""
    pid_k, pid_s = tl.program_id(0), tl.program_id(1)
    k0 = pid_k * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    mask_k, mask_r = offs_k < K, offs_r < R
    acc = tl.zeros((BLOCK_R, BLOCK_K), dtype=tl.float32)
    for m0 in range(0, rows_per_split, BLOCK_M):
        offs_m = pid_s * rows_per_split + m0 + tl.arange(0, BLOCK_M)
        mask_m = offs_m < M
        x = tl.load(x_ptr + offs_m[:, None].to(tl.int64) * stride_xm + offs_k[None, :],
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0).to(tl.float32)
        x = tl.where(_load_keep_tile(bits_ptr, offs_m, mask_m, k0, K, BLOCK_M, BLOCK_K), x, 0.0)
        dxa_t = tl.load(dxa_ptr + offs_m[None, :] * R + offs_r[:, None], mask=mask_r[:, None] & mask_m[None, :],
                        other=0.0).to(tl.float32)
        acc += tl.dot(dxa_t, x, input_precision=DOT_PRECISION)
    tl.store(part_ptr + pid_s * R * K + offs_r[:, None] * K + offs_k[None, :], acc,
             mask=mask_r[:, None] & mask_k[None, :])


@triton.jit
def _up_kernel(dxa_ptr, a_ptr, bits_ptr, out_ptr, M, K, R, factor, DOT_PRECISION: tl.constexpr,
               BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr):
    """out = factor · keep ⊙ (dxa A) for one (rows, columns) tile: the LoRA part of dx."""
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    k0 = tl.program_id(1) * BLOCK_K
    offs_k = k0 + tl.arange(0, BLOCK_K)
    offs_r = tl.arange(0, BLOCK_R)
    mask_m, mask_k, mask_r = offs_m < M, offs_k < K, offs_r < R
    dxa = tl.load(dxa_ptr + offs_m[:, None] * R + offs_r[None, :], mask=mask_m[:, None] & mask_r[None, :],
                  other=0.0).to(tl.float32)
    a = tl.load(a_ptr + offs_r[:, None] * K + offs_k[None, :], mask=mask_r[:, None] & mask_k[None, :],
                other=0.0).to(tl.float32)
    out = tl.dot(dxa, a, input_precision=DOT_PRECISION) * factor
    out = tl.where(_load_keep_tile(bits_ptr, offs_m, mask_m, k0, K, BLOCK_M, BLOCK_K), out, 0.0)
    tl.store(out_ptr + offs_m[:, None].to(tl.int64) * K + offs_k[None, :], out.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_k[None, :])


# ---------------------------------------------------------------------------------------------
# Launchers (Triton) and their torch twins
# ---------------------------------------------------------------------------------------------

def _use_triton(t: torch.Tensor) -> bool:
    return t.is_cuda or _INTERPRET


def _launch_args(t: torch.Tensor, rank: int) -> dict:
    # Half inputs are exact in tf32, so the tensor cores lose nothing; fp32 keeps full precision
    # (FMA dots: more registers, hence more warps).
    fp32 = t.dtype == torch.float32
    return dict(DOT_PRECISION="ieee" if fp32 else "tf32", BLOCK_M=BLOCK_M, BLOCK_K=BLOCK_K,
                BLOCK_R=max(16, triton.next_power_of_2(rank)), num_warps=8 if fp32 or rank > 64 else 4)


def _inv_keep(p: float) -> float:
    return 1.0 / (1.0 - p) if p < 1 else 0.0      # p == 1 drops everything, like F.dropout


def _check_counter_range(rows: int, cols: int) -> None:
    if (rows + BLOCK_M) * triton.cdiv(cols, 4) >= 2**31:
        raise ValueError(f"lora_linear dropout: {rows}×{cols} exceeds the int32 Philox counter range")


def lora_down(x2: torch.Tensor, a: torch.Tensor, seed: torch.Tensor | None = None,
              p: float = 0.0) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Triton xa = dropout(x2) Aᵀ for 2-D x2 (unit column stride) and contiguous A.

    With a seed: dropout with probability p and the packed keep mask (int32, M × ⌈K/32⌉); without:
    the plain skinny GEMM and None.
    """
    M, K = x2.shape
    R = a.shape[0]
    xa = torch.empty(M, R, dtype=x2.dtype, device=x2.device)
    bits = None if seed is None else torch.empty(M, triton.cdiv(K, 32), dtype=torch.int32, device=x2.device)
    if seed is not None:
        _check_counter_range(M, K)
    _down_kernel[(triton.cdiv(M, BLOCK_M),)](
        x2, a, xa, xa if bits is None else bits, xa if seed is None else seed, M, K, R, x2.stride(0),
        p, _inv_keep(p), HAS_DROPOUT=seed is not None, **_launch_args(x2, R))
    return xa, bits


def _row_splits(M: int, K: int, device: torch.device) -> int:
    """Rows per program of the dA reduction: about two programs per SM, in whole row blocks."""
    programs = 2 * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    row_blocks = triton.cdiv(M, BLOCK_M)
    splits = max(1, min(row_blocks, triton.cdiv(programs, triton.cdiv(K, BLOCK_K))))
    return triton.cdiv(row_blocks, splits) * BLOCK_M


def _dropout_down(x2, a, seed, p):
    if _use_triton(x2):
        return lora_down(x2, a, seed, p)
    keep = dropout_mask(seed, *x2.shape, p)
    xa = torch.empty(x2.shape[0], a.shape[0], dtype=x2.dtype, device=x2.device)
    return xa.addmm_(x2 * keep, a.t(), beta=0, alpha=_inv_keep(p)), _pack_bits(keep)


def _dropout_grad_a(dxa, x2, bits, factor):
    """factor · dxaᵀ (x2 ⊙ keep), the (r, in) LoRA-A gradient."""
    M, K = x2.shape
    R = dxa.shape[1]
    if not _use_triton(x2):
        return scaled_mm(dxa.t(), x2 * _unpack_bits(bits, K), factor)
    rows_per_split = _row_splits(M, K, x2.device)
    splits = triton.cdiv(M, rows_per_split)
    part = torch.empty(splits, R, K, dtype=torch.float32, device=x2.device)
    _grad_a_kernel[(triton.cdiv(K, BLOCK_K), splits)](dxa, x2, bits, part, M, K, R, x2.stride(0), rows_per_split,
                                                      **_launch_args(x2, R))
    return (part.sum(0) * factor).to(x2.dtype)


def _dropout_up(dxa, a, bits, factor):
    """factor · keep ⊙ (dxa A), the (M, in) LoRA part of dx."""
    M, R = dxa.shape
    K = a.shape[1]
    if not _use_triton(dxa):
        return scaled_mm(dxa, a, factor).mul_(_unpack_bits(bits, K))
    out = torch.empty(M, K, dtype=dxa.dtype, device=dxa.device)
    _up_kernel[(triton.cdiv(M, BLOCK_M), triton.cdiv(K, BLOCK_K))](dxa, a, bits, out, M, K, R, factor,
                                                                   **_launch_args(dxa, R))
    return out



# ---------------------------------------------------------------------------------------------
# Autograd
# ---------------------------------------------------------------------------------------------

FOLD_INTO_GEMM = False     # the rank-r product in the base GEMM's epilogue (kernels/triton_lora_gemm.py); see kernels/ops.py


def _folds(bits, a: torch.Tensor) -> bool:
    """Without dropout (its mask is applied between the two LoRA GEMMs), up to MAX_RANK."""
    return FOLD_INTO_GEMM and bits is None and a.shape[0] <= MAX_RANK


class LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, lora_a, lora_b, scale, p):
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        a = lora_a.contiguous()
        if p > 0:
            xa, bits = _dropout_down(x2, a, dropout_seed(x.device), p)
        else:
            xa, bits = torch.mm(x2, a.t()), None
        if _folds(bits, a):
            y = lora_gemm(x2, weight.t(), xa, lora_b.t(), scale)
        else:
            y = scaled_mm(xa, lora_b.t(), scale)
            y.addmm_(x2, weight.t())             # the base GEMM accumulates onto the LoRA term
        ctx.save_for_backward(x2, weight, a, lora_b, xa, bits)
        ctx.scale, ctx.p, ctx.x_shape = scale, p, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight, a, b, xa, bits = ctx.saved_tensors
        need_x, _, need_a, need_b = ctx.needs_input_grad[:4]
        scale = ctx.scale
        factor = scale * _inv_keep(ctx.p)
        dx = da = db = None
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1])
            if need_b:
                db = scaled_mm(dy2.t(), xa, scale)
            if need_x or need_a:
                dxa = torch.mm(dy2, b)
            if need_a:
                da = scaled_mm(dxa.t(), x2, scale) if bits is None else _dropout_grad_a(dxa, x2, bits, factor)
            if need_x and _folds(bits, a):
                dx = lora_gemm(dy2, weight, dxa, a, scale).view(ctx.x_shape)
            elif need_x:
                dx = scaled_mm(dxa, a, scale) if bits is None else _dropout_up(dxa, a, bits, factor)
                dx = dx.addmm_(dy2, weight).view(ctx.x_shape)
        return dx, None, da, db, None, None


def lora_linear(x: torch.Tensor, weight: torch.Tensor, lora_a: torch.Tensor, lora_b: torch.Tensor,
                scale: float, dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """y = x Wᵀ + scale · dropout(x) Aᵀ Bᵀ, with W (out, in) frozen, A (r, in), B (out, r), x (..., in).

    Under autocast the inputs are cast to the autocast dtype first, like F.linear's.
    """
    if weight.requires_grad and torch.is_grad_enabled():
        raise ValueError("lora_linear never computes the base weight's gradient: freeze it "
                         "(weight.requires_grad_(False)) or use kernels.reference.lora_linear")
    p = float(dropout) if training and dropout > 0 else 0.0
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, weight, lora_a, lora_b = (t.to(dtype) for t in (x, weight, lora_a, lora_b))
        with torch.autocast(device_type, enabled=False):
            return LoRALinearFunction.apply(x, weight, lora_a, lora_b, float(scale), p)
    return LoRALinearFunction.apply(x, weight, lora_a, lora_b, float(scale), p)
