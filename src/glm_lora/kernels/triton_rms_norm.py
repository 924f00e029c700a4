"""Fused RMSNorm in Triton, forward and backward, optionally with the residual add before it.

Same semantics as `kernels.reference.rms_norm` / `add_rms_norm`: normalise in fp32, cast to x's dtype,
multiply by the weight in the promoted dtype, round to `out_dtype` if given (the dtype autocast would cast
the result to before a matrix product: written once, in it, instead of fp32 then a cast). With a residual
the kernel adds it first and writes the sum too (the residual stream), and the backward adds the sum's own
incoming gradient to dx: the stream's add and its gradient's accumulation cost no pass of their own.
One program normalises one row; the backward gives each program a contiguous slab of rows and writes a
per-program fp32 partial of dweight, summed afterwards in torch.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

MAX_BLOCK = 65536
PROGRAMS_PER_SM = 4


@triton.jit
def _rms_norm_fwd_kernel(
    X, R, S, Y, W, RSTD,
    stride_x, stride_r, stride_s, stride_y,
    n_cols, eps,
    HAS_RES: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:     # S = X + R in S's (the promoted) dtype, as torch adds them
        x = (x + tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)).to(S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, x, mask=mask)
        x = x.to(tl.float32)
    rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / n_cols + eps)
    tl.store(RSTD + row, rstd)
    # Round the normalised row to the normalised input's dtype (S is X without a residual) before the weight
    # multiply, as the reference does.
    n = (x * rstd).to(S.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, (w * n).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_kernel(
    DY, X, W, RSTD, DX, DW, DS,
    stride_dy, stride_x, stride_dx, stride_ds,
    n_rows, n_cols, rows_per_program,
    COMPUTE_DX: tl.constexpr, COMPUTE_DW: tl.constexpr, HAS_DS: tl.constexpr, BLOCK: tl.constexpr,
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
            if HAS_DS:      # the residual stream's own gradient, accumulated here rather than by autograd
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


def _forward(x, weight, eps, out_dtype, residual=None):
    """(normalised rows, rstd, the sum x + residual or None)."""
    shape, n_cols = x.shape, x.shape[-1]
    x2 = _rows(x)
    s = None
    if residual is not None:
        r2 = _rows(residual)
        s = torch.empty(x2.shape, dtype=torch.promote_types(x.dtype, residual.dtype), device=x.device)
    y = torch.empty(x2.shape, dtype=out_dtype or torch.promote_types(x2.dtype if s is None else s.dtype, weight.dtype),
                    device=x.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    block, num_warps = _settings(n_cols)
    _rms_norm_fwd_kernel[(x2.shape[0],)](
        x2, x2 if s is None else r2, x2 if s is None else s, y, weight, rstd,
        x2.stride(0), 0 if s is None else r2.stride(0), x2.stride(0) if s is None else s.stride(0), y.stride(0),
        n_cols, eps,
        HAS_RES=s is not None, BLOCK=block, num_warps=num_warps,
    )
    return y.view(shape), rstd, None if s is None else s.view(shape)


def _backward(dy, x, weight, rstd, compute_dx, compute_dw, ds=None):
    """dx (with `ds`, the normalised input's own incoming gradient, added to it) and dweight."""
    shape, n_cols = dy.shape, dy.shape[-1]
    dy2, x2 = _rows(dy), _rows(x)
    ds2 = None if ds is None or not compute_dx else _rows(ds)
    n_rows = x2.shape[0]
    n_prog = _num_programs(n_rows, dy.device, compute_dw)
    dx = torch.empty_like(x2) if compute_dx else None
    dw = torch.empty(n_prog, n_cols, dtype=torch.float32, device=dy.device) if compute_dw else None
    block, num_warps = _settings(n_cols)
    _rms_norm_bwd_kernel[(n_prog,)](
        dy2, x2, weight, rstd, dx if compute_dx else dy2, dw if compute_dw else rstd, dy2 if ds2 is None else ds2,
        dy2.stride(0), x2.stride(0), dx.stride(0) if compute_dx else 0, 0 if ds2 is None else ds2.stride(0),
        n_rows, n_cols, triton.cdiv(n_rows, n_prog),
        COMPUTE_DX=compute_dx, COMPUTE_DW=compute_dw, HAS_DS=ds2 is not None, BLOCK=block, num_warps=num_warps,
    )
    return (dx.view(shape) if compute_dx else None), (dw.sum(0).to(weight.dtype) if compute_dw else None)


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps, out_dtype):
        weight = weight.contiguous()
        y, rstd, _ = _forward(x, weight, eps, out_dtype)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = _backward(dy, x, weight, rstd, ctx.needs_input_grad[0], ctx.needs_input_grad[1])
        return dx, dw, None, None


class AddRMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, residual, weight, eps, out_dtype):
        weight = weight.contiguous()
        y, rstd, s = _forward(x, weight, eps, out_dtype, residual)
        ctx.save_for_backward(s, weight, rstd)
        ctx.dtypes = x.dtype, residual.dtype
        return s, y

    @staticmethod
    def backward(ctx, ds, dy):
        s, weight, rstd = ctx.saved_tensors
        need_x, need_res, need_w = ctx.needs_input_grad[:3]
        d, dw = _backward(dy, s, weight, rstd, need_x or need_res, need_w, ds)
        # d(x + residual) is the same for both, each in its input's dtype
        dx, dres = (d.to(dtype) if need else None for need, dtype in zip((need_x, need_res), ctx.dtypes))
        return dx, dres, dw, None, None


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading dims); matches `kernels.reference.rms_norm`."""
    return RMSNormFunction.apply(x, weight, eps, out_dtype)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 out_dtype: torch.dtype | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, its RMSNorm) in one pass; matches `kernels.reference.add_rms_norm`."""
    return AddRMSNormFunction.apply(x, residual, weight, eps, out_dtype)

