"""LoRA linear over a 4-bit base (QLoRA, arXiv:2305.14314): y = x Wᵀ + scale · dropout(x) Aᵀ Bᵀ.

The semantics of `kernels.reference.lora_linear`, with W held compressed: `weight` is any object whose
`dequantize(dtype)` returns the (out, in) weight (model.quant.NF4Weight). Forward dequantises W, uses it and
drops it; backward dequantises it again for dx. So no full-size weight outlives a call: saved for backward
are x, xa = dropout(x) Aᵀ (M×r), A, B and, with dropout, the keep mask (1 byte per element of x).
W is frozen: gradients flow to x, A and B only. As in the fused LoRA kernel, the base GEMM accumulates
onto the LoRA term in one buffer (forward y, backward dx), so no separate M×out LoRA tensor exists.
"""
from __future__ import annotations

import torch

from glm_lora.kernels.reference import scaled_mm


class NF4LoRALinearFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, lora_a, lora_b, weight, scale, p):
        x2 = x.reshape(-1, x.shape[-1])
        inv_keep = 1.0 / (1.0 - p) if p < 1 else 0.0      # p == 1 drops everything, like F.dropout
        keep = torch.rand(x2.shape, device=x.device) >= p if p > 0 else None
        xa = scaled_mm(x2 if keep is None else x2 * keep, lora_a.t(), inv_keep)
        y = scaled_mm(xa, lora_b.t(), scale)
        y.addmm_(x2, weight.dequantize(x.dtype).t())     # the dequantised W is freed on return
        ctx.save_for_backward(x2, lora_a, lora_b, xa, keep)
        ctx.weight, ctx.scale, ctx.inv_keep, ctx.x_shape = weight, scale, inv_keep, x.shape
        return y.view(*x.shape[:-1], y.shape[-1])

    @staticmethod
    def backward(ctx, dy):
        x2, a, b, xa, keep = ctx.saved_tensors
        need_x, need_a, need_b = ctx.needs_input_grad[:3]
        dx = da = db = None
        factor = ctx.scale * ctx.inv_keep
        with torch.autocast(dy.device.type, enabled=False):
            dy2 = dy.reshape(-1, dy.shape[-1])
            if need_b:
                db = scaled_mm(dy2.t(), xa, ctx.scale)
            if need_x or need_a:
                dxa = dy2 @ b
            if need_a:
                da = scaled_mm(dxa.t(), x2 if keep is None else x2 * keep, factor)
            if need_x:
                dx = scaled_mm(dxa, a, factor)
                if keep is not None:
                    dx.mul_(keep)
                dx = dx.addmm_(dy2, ctx.weight.dequantize(dy.dtype)).view(ctx.x_shape)
        return dx, da, db, None, None, None


def nf4_lora_linear(x: torch.Tensor, weight, lora_a: torch.Tensor, lora_b: torch.Tensor, scale: float,
                    dropout: float = 0.0, training: bool = False) -> torch.Tensor:
    """y = x Wᵀ + scale · dropout(x) Aᵀ Bᵀ with W = weight.dequantize(dtype) (out, in), A (r, in), B (out, r).

    Under autocast, x, A and B are cast to the autocast dtype and W is dequantised straight into it.
    """
    p = float(dropout) if training and dropout > 0 else 0.0
    device_type = x.device.type
    if torch.is_autocast_enabled(device_type):
        dtype = torch.get_autocast_dtype(device_type)
        x, lora_a, lora_b = (t.to(dtype) for t in (x, lora_a, lora_b))
        with torch.autocast(device_type, enabled=False):
            return NF4LoRALinearFunction.apply(x, lora_a, lora_b, weight, float(scale), p)
    return NF4LoRALinearFunction.apply(x, lora_a, lora_b, weight, float(scale), p)
