"""Fused SwiGLU, silu(gate) * up, in Triton: forward and backward over the flattened elements.

Same semantics as `kernels.reference.swiglu` for same-shape, same-dtype inputs. Only gate and up are
saved; the backward recomputes sigmoid(gate) instead of keeping silu(gate) alive.

`swiglu_halves(gate_up)` takes the stacked projection [gate | up] (..., 2I) as it comes out of one GEMM
(GLM's gate_up_proj, or gate/up stacked: model.project) and reads both halves in place: no copies of
the strided halves in forward, and one (..., 2I) gradient in backward, for the GEMM that made it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024
NUM_WARPS = 4


@triton.jit
def _swiglu_fwd_kernel(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu / dg = sig * (1 + g * (1 - sig))
    dg = dy * u * sig * (1.0 + g * (1.0 - sig))
    tl.store(DG + offs, dg.to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int]:
    return (triton.cdiv(n, BLOCK),)


@triton.jit
def _halves_fwd_kernel(GU, Y, n, half, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src = (offs // half) * (2 * half) + offs % half          # row r, column c → gate at r·2I + c, up I later
    g = tl.load(GU + src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + src + half, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + offs, (g * tl.sigmoid(g) * u).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _halves_bwd_kernel(DY, GU, DGU, n, half, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    src = (offs // half) * (2 * half) + offs % half
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GU + src, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + src + half, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    tl.store(DGU + src, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DGU.dtype.element_ty), mask=mask)
    tl.store(DGU + src + half, (dy * silu).to(DGU.dtype.element_ty), mask=mask)


class SwiGLUHalvesFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate_up):
        gate_up = gate_up.contiguous()
        half = gate_up.shape[-1] // 2
        y = gate_up.new_empty(*gate_up.shape[:-1], half)
        _halves_fwd_kernel[_grid(y.numel())](gate_up, y, y.numel(), half, BLOCK=BLOCK, num_warps=NUM_WARPS)
        ctx.save_for_backward(gate_up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate_up, = ctx.saved_tensors
        dy = dy.contiguous()
        dgu = torch.empty_like(gate_up)
        _halves_bwd_kernel[_grid(dy.numel())](dy, gate_up, dgu, dy.numel(), gate_up.shape[-1] // 2,
                                              BLOCK=BLOCK, num_warps=NUM_WARPS)
        return dgu


def swiglu_halves(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for gate_up = [gate | up] on the last dim (an even width)."""
    if gate_up.shape[-1] % 2:
        raise ValueError(f"swiglu_halves: the last dim ({gate_up.shape[-1]}) must be [gate | up], an even width")
    return SwiGLUHalvesFunction.apply(gate_up)


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        gate, up = gate.contiguous(), up.contiguous()
        y = torch.empty_like(gate)
        _swiglu_fwd_kernel[_grid(gate.numel())](gate, up, y, gate.numel(), BLOCK=BLOCK, num_warps=NUM_WARPS)
        ctx.save_for_backward(gate, up)
        return y

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        dy = dy.contiguous()
        dgate, dup = torch.empty_like(gate), torch.empty_like(up)
        _swiglu_bwd_kernel[_grid(gate.numel())](dy, gate, up, dgate, dup, gate.numel(),
                                                BLOCK=BLOCK, num_warps=NUM_WARPS)
        return dgate, dup


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise; gate and up must have the same shape and dtype."""
    if gate.shape != up.shape or gate.dtype != up.dtype:
        raise ValueError(f"swiglu: gate {tuple(gate.shape)} {gate.dtype} and up {tuple(up.shape)} {up.dtype} must match")
    return SwiGLUFunction.apply(gate, up)
