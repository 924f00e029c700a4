"""The routed experts of a mixture-of-experts layer, as grouped GEMMs over tokens sorted by expert.

Each token's k chosen experts make N·k (token, expert) rows; sorted by expert, every expert's rows are
contiguous, so an expert's weight multiplies one block of rows (`kernels.grouped_mm`: Triton on CUDA, a loop
over experts in kernels/reference.py elsewhere). Then SwiGLU, the down projection the same way, each row
scaled by its routing weight and summed back into its token. LoRA on the experts (model/lora.py LoRAExperts)
rides in the same grouped GEMMs (`kernels.grouped_lora_mm`).

The result equals transformers' Glm4MoeExperts loop (one matmul per expert hit) up to the order of the
per-token sums: fp32 parity is tested to 1e-5 (tests/model/test_moe.py). Under bf16 autocast the routing weights
are rounded to bf16 for the final weighted sum (transformers multiplies in fp32 and rounds the product).
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from glm_lora.kernels.reference import NF4Stack


class ExpertLoRA(NamedTuple):
    """Per-expert LoRA factors for one projection: y += scale · (x aₑᵀ) bₑᵀ, a (E, r, in), b (E, out, r)."""

    a: torch.Tensor
    b: torch.Tensor
    scale: float


def sort_by_expert(experts: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """experts (N, k) → (order, token, offsets): `order` sorts the N·k flattened (token, expert) rows by
    expert (stable: tokens in order within an expert), `token` is each sorted row's token, `offsets` (E,)
    int32 the cumulative end row of each expert (torch._grouped_mm's `offs`). No host sync."""
    flat = experts.flatten()
    order = flat.argsort(stable=True)
    counts = torch.bincount(flat, minlength=num_experts)
    return order, order // experts.shape[1], counts.cumsum(0).to(torch.int32)


def _project(x: torch.Tensor, weight: torch.Tensor | NF4Stack, offsets: torch.Tensor,
             lora: ExpertLoRA | None) -> torch.Tensor:
    from glm_lora.kernels import ops as kernels
    if isinstance(weight, NF4Stack):
        return kernels.grouped_nf4_mm(x, weight, offsets, *(lora or ()))
    if lora is None:
        return kernels.grouped_mm(x, weight, offsets)
    return kernels.grouped_lora_mm(x, weight, lora.a, lora.b, lora.scale, offsets)


def moe_experts(x: torch.Tensor, experts: torch.Tensor, weights: torch.Tensor, gate_up: torch.Tensor | NF4Stack,
                down: torch.Tensor | NF4Stack, gate_up_lora: ExpertLoRA | None = None,
                down_lora: ExpertLoRA | None = None) -> torch.Tensor:
    """Σ over each token's chosen experts e of weight · down_e(silu(gate_e x) · up_e x).

    x (N, C); experts, weights (N, k); gate_up (E, 2I, C) with [gate | up] rows; down (E, C, I); either may be a
    frozen 4-bit stack (QLoRA: kernels.reference.NF4Stack, dequantised for the grouped GEMM). Under autocast x
    is cast before it is gathered (the GEMMs take that dtype anyway: half the bytes moved) and the result is in it.
    """
    from glm_lora.kernels import ops as kernels
    if torch.is_autocast_enabled(x.device.type):
        x = x.to(torch.get_autocast_dtype(x.device.type))
    N, k = experts.shape
    order, token, offsets = sort_by_expert(experts, gate_up.shape[0])
    rows = x[token]                                                      # (N·k, C), sorted by expert
    h = _project(rows, gate_up, offsets, gate_up_lora)                   # (N·k, 2I)
    inter = down.shape[-1]
    y = _project(kernels.swiglu(h[:, :inter], h[:, inter:]), down, offsets, down_lora)    # (N·k, C)
    # Back to token order (row i of y is flat (token, slot) order[i]), then each token's k rows weighted and summed
    # by one batched matmul, accumulated in fp32: no (N·k, C) fp32 temporary, no scatter-add.
    y = torch.index_copy(torch.empty_like(y), 0, order, y).view(N, k, -1)                # (N, k, C)
    return torch.bmm(weights.to(y.dtype).unsqueeze(1), y).squeeze(1)                    # (N, C)
