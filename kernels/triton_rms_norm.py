"""Fused RMSNorm (and residual-add + RMSNorm) in Triton, forward and backward.

Same semantics as `kernels.reference.rms_norm`: normalise in fp32, cast to x's dtype, multiply by the
weight in the promoted dtype. One program normalises one row; the backward gives each program a
contiguous slab of rows and writes a per-program fp32 partial of dweight, summed afterwards in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels import reference

MAX_BLOCK = 65536
PROGRAMS_PER_SM = 4


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, S, Y, W, RSTD,
    stride_x, stride_r, stride_s, stride_y,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = (x + r).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    # Round the normalised row to x's dtype before the weight multiply, as the reference does.
    n = (x * rstd).to(X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * n).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DS, DX, DW,
    stride_dy, stride_x, stride_ds, stride_dx,
    n_rows, n_cols, rows_per_program,
    HAS_DS: tl.constexpr, COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr, BLOCK: tl.constexpr,
):
    pid = tl.program_id(0).to(tl.int64)
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, n_rows)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in range(row_start, row_end):
        x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        n = x * rstd
        if COMPUTE_DW:
            dw += dy * n.to(X.dtype.element_ty).to(tl.float32)
        if COMPUTE_DX:
            dn = dy * w
            dx = rstd * (dn - n * (tl.sum(dn * n, axis=0) / n_cols))
            if HAS_DS:
                dx += tl.load(DS + row * stride_ds + cols, mask=mask, other=0.0).to(tl.float32)
            tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)
    if COMPUTE_DW:
        tl.store(DW + pid * n_cols + cols, dw, mask=mask)


def _settings(n_cols: int) -> tuple[int, int]:
    block = triton.next_power_of_2(n_cols)
    if block > MAX_BLOCK:
        raise ValueError(f"rms_norm: rows of {n_cols} exceed the {MAX_BLOCK}-wide block limit")
    num_warps = 32 if block >= 32768 else 16 if block >= 8192 else 8 if block >= 2048 else 4
    return block, num_warps


def _rows(t: torch.Tensor) -> torch.Tensor:
    t = t.reshape(-1, t.shape[-1])
    return t if t.stride(-1) == 1 else t.contiguous()


def _num_programs(n_rows: int, device: torch.device, compute_dw: bool) -> int:
    """Without dweight every row is independent: one program each. With it, each program keeps one
    fp32 partial row, so use a few programs per SM (several in flight per SM hide load latency);
    a handful under the interpreter, whose cost is per row anyway."""
    if not compute_dw:
        return max(1, n_rows)
    n = PROGRAMS_PER_SM * torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4
    return max(1, min(n, n_rows))


def _forward(x, residual, weight, eps):
    shape, n_cols = x.shape, x.shape[-1]
    x2 = _rows(x)
    r2 = _rows(residual) if residual is not None else x2
    s2 = torch.empty_like(x2) if residual is not None else x2
    y = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, weight.dtype), device=x.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    block, num_warps = _settings(n_cols)
    _rms_norm_fwd_kernel[(x2.shape[0],)](
        x2, r2, s2, y, weight, rstd,
        x2.stride(0), r2.stride(0), s2.stride(0), y.stride(0),
        n_cols, eps,
        HAS_RESIDUAL=residual is not None, BLOCK=block, num_warps=num_warps,
    )
    return y.view(shape), (s2.view(shape) if residual is not None else None), rstd


def _backward(dy, xn, weight, rstd, ds, compute_dx, compute_dw):
    """xn is the normalised input (x, or x + residual); ds the gradient of the sum output, if any."""
    shape, n_cols = dy.shape, dy.shape[-1]
    dy2, x2 = _rows(dy), _rows(xn)
    ds2 = _rows(ds) if ds is not None else dy2
    n_rows = x2.shape[0]
    n_prog = _num_programs(n_rows, dy.device, compute_dw)
    dx = torch.empty_like(x2) if compute_dx else None
    dw = torch.empty(n_prog, n_cols, dtype=torch.float32, device=dy.device) if compute_dw else None
    block, num_warps = _settings(n_cols)
    _rms_norm_bwd_kernel[(n_prog,)](
        dy2, x2, weight, rstd, ds2, dx if compute_dx else dy2, dw if compute_dw else rstd,
        dy2.stride(0), x2.stride(0), ds2.stride(0), dx.stride(0) if compute_dx else 0,
        n_rows, n_cols, triton.cdiv(n_rows, n_prog),
        HAS_DS=ds is not None, COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw, BLOCK=block, num_warps=num_warps,
    )
    return (dx.view(shape) if compute_dx else None), (dw.sum(0).to(weight.dtype) if compute_dw else None)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        weight = weight.contiguous()
        y, _, rstd = _forward(x, None, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, x, weight, rstd, None, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None


class AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps):
        weight = weight.contiguous()
        y, s, rstd = _forward(x, residual, weight, eps)
        ctx.save_for_backward(s, weight, rstd)
        return y, s

    @staticmethod
    def backward(ctx, dy, ds):
        s, weight, rstd = ctx.saved_tensors
        compute_dx = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        dx, dw = _backward(dy, s, weight, rstd, ds, compute_dx, ctx.needs_input_grad[2])
        # d(x + residual)/dx = d/dresidual = 1: both get the same gradient, as torch's add does.
        return dx, dx, dw, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading dims); matches `kernels.reference.rms_norm`."""
    return RMSNormFunction.apply(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(x + residual), x + residual) in one pass; x and residual share shape and dtype."""
    if x.shape != residual.shape or x.dtype != residual.dtype:
        raise ValueError(f"add_rms_norm: x {tuple(x.shape)} {x.dtype} and residual "
                         f"{tuple(residual.shape)} {residual.dtype} must match")
    return AddRMSNormFunction.apply(x, residual, weight, eps)


def add_rms_norm_reference(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                           eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Pure-torch reference for `add_rms_norm`."""
    s = x + residual
    return reference.rms_norm(s, weight, eps), s
