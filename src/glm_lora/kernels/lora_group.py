"""Sibling LoRA linears over one input (q/k/v, gate/up) as one op: y_i = x W_iᵀ + s · (x A_iᵀ) B_iᵀ.

The siblings' frozen weights W_i are stacked into one (Σout, in) GEMM and their down-projections A_i into one
(Σr, in) GEMM, so a q/k/v group takes 2 + 3 matrix products forward instead of 9 and backward one input
gradient (dx = s·dxa·A + dy·W, each one GEMM) instead of three summed: 9 products instead of 15, one cast of x
under autocast instead of three. As in `triton_lora_linear`, the rank-r products are written first and the
base GEMM accumulates onto them (beta=1), so no separate LoRA term of the output's size exists. Plain torch
GEMMs, so one path for CPU and CUDA. Specification: `reference.lora_linear_group` (each sibling alone).
W must not require grad; every sibling shares one scale (one LoRA config) and has no dropout.
"""
from __future__ import annotations

import itertools

import torch


def _offsets(sizes: tuple[int, ...]) -> list[tuple[int, int]]:
    """(start, end) of each block laid side by side."""
    ends = list(itertools.accumulate(sizes))
    return list(zip([0] + ends[:-1], ends))


class LoRAGroupFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, lora_a, scale, ranks, *lora_bs):
        x2 = x.reshape(-1, x.shape[-1])
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        outs = tuple(b.shape[0] for b in lora_bs)
        xa = torch.mm(x2, lora_a.t())                                           # (M, Σr)
        y = torch.empty(x2.shape[0], weight.shape[0], dtype=x2.dtype, device=x2.device)
        for (o0, o1), (r0, r1), b in zip(_offsets(outs), _offsets(ranks), lora_bs):
            y[:, o0:o1].addmm_(xa[:, r0:r1], b.t(), beta=0, alpha=scale)
        y.addmm_(x2, weight.t())                     # the stacked base GEMM accumulates onto the LoRA terms
        ctx.save_for_backward(x2, weight, lora_a, xa, *lora_bs)
        ctx.scale, ctx.ranks, ctx.outs, ctx.x_shape = scale, ranks, outs, x.shape
        return y.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, dy):
        x2, weight, a, xa, *bs = ctx.saved_tensors
        need_x, _, need_a = ctx.needs_input_grad[:3]
        scale = ctx.scale
        dx = da = None
        dbs = [None] * len(bs)
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1])
            dxa = torch.empty_like(xa)
            for i, ((o0, o1), (r0, r1), b) in enumerate(zip(_offsets(ctx.outs), _offsets(ctx.ranks), bs)):
                if ctx.needs_input_grad[5 + i]:
                    dbs[i] = torch.empty_like(b).addmm_(dy2[:, o0:o1].t(), xa[:, r0:r1], beta=0, alpha=scale)
                dxa[:, r0:r1].addmm_(dy2[:, o0:o1], b, beta=0)
            if need_a:
                da = torch.empty_like(a).addmm_(dxa.t(), x2, beta=0, alpha=scale)
            if need_x:
                dx = torch.empty_like(x2).addmm_(dxa, a, beta=0, alpha=scale).addmm_(dy2, weight).view(ctx.x_shape)
        return (dx, None, da, None, None, *dbs)


def stack_rows(tensors: list[torch.Tensor], dtype: torch.dtype | None = None) -> torch.Tensor:
    """The 2-D tensors one above another, in `dtype` (default: the first's): a view where they already are
    consecutive row blocks of one contiguous storage in that dtype (model.lora.share_frozen_storage lays frozen
    siblings out so), a new tensor (torch.cat) otherwise."""
    first = tensors[0]
    dtype = dtype or first.dtype
    if not torch.compiler.is_compiling() and _consecutive_rows(tensors, dtype):
        return first.as_strided((sum(t.shape[0] for t in tensors), first.shape[1]), first.stride())
    return torch.cat([t.to(dtype) for t in tensors])


def _consecutive_rows(tensors: list[torch.Tensor], dtype: torch.dtype) -> bool:
    first = tensors[0]
    storage, offset = first.untyped_storage().data_ptr(), first.storage_offset()
    for t in tensors:
        if not (t.dtype == dtype and t.dim() == 2 and t.shape[1] == first.shape[1] and t.is_contiguous()
                and t.untyped_storage().data_ptr() == storage and t.storage_offset() == offset):
            return False
        offset += t.numel()
    return True


def lora_linear_group(x: torch.Tensor, weights: list[torch.Tensor], lora_as: list[torch.Tensor],
                      lora_bs: list[torch.Tensor], scale: float) -> torch.Tensor:
    """[x W_iᵀ + scale · x A_iᵀ B_iᵀ for each sibling i] side by side on the last dim (..., Σ out_i), with W_i
    (out_i, in) frozen, A_i (r_i, in), B_i (out_i, r_i).

    Under autocast the inputs are cast to the autocast dtype first, like F.linear's."""
    if torch.is_grad_enabled() and any(w.requires_grad for w in weights):
        raise ValueError("lora_linear_group never computes the base weights' gradients: freeze them "
                         "or use kernels.reference.lora_linear_group")
    device_type = x.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else x.dtype
    weight = stack_rows(weights, dtype)
    lora_a = torch.cat([a.to(dtype) for a in lora_as])
    ranks = tuple(a.shape[0] for a in lora_as)
    with torch.autocast(device_type, enabled=False):
        return LoRAGroupFunction.apply(x.to(dtype), weight, lora_a, float(scale), ranks, *(b.to(dtype) for b in lora_bs))
