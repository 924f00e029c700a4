"""Gated DeltaNet's kernels on CUDA from flash-linear-attention (PyPI `flash-linear-attention`, the field's library
for them; optional: `pip install flash-linear-attention`), for kernels/ops.py. Packed rows (delta_rule.PackedRows) go
in as one sequence per document (cu_seqlens), so no document's state or convolution window reaches the next. The pure-torch
reference they are tested against is kernels/delta_rule.py."""
from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    try:
        import fla.modules.causal_conv1d  # noqa: F401
        import fla.ops.gated_delta_rule  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def backward_ok() -> bool:
    """fla 0.6 refuses its gated chunk backward on Hopper under Triton ≥ 3.4, < 3.7.1 (wrong results upstream, its
    issue #640) — torch 2.11's Triton 3.6 on an H100: there a step that needs gradients takes the reference."""
    from fla.utils import IS_NVIDIA_HOPPER, TRITON_ABOVE_3_4_0, TRITON_ABOVE_3_7_1
    return not (IS_NVIDIA_HOPPER and TRITON_ABOVE_3_4_0 and not TRITON_ABOVE_3_7_1)


def _cu_seqlens(rows, B: int, T: int, device) -> torch.Tensor:
    """Each sequence's start in the rows flattened to one, and the end: the documents of packed rows, else the rows."""
    return rows.cu_seqlens if rows is not None else torch.arange(0, B * T + 1, T, device=device, dtype=torch.int32)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, rows) -> torch.Tensor:
    from fla.modules.causal_conv1d import causal_conv1d as conv
    B, T, D = x.shape
    y, _ = conv(x.reshape(1, B * T, D), weight.to(x.dtype), activation="silu", cu_seqlens=_cu_seqlens(rows, B, T, x.device))
    return y.reshape(B, T, D)


def gated_delta_rule(q, k, v, g, beta, rows) -> torch.Tensor:
    """q, k with fewer heads than v are shared by value heads as fla's own grouped form takes them."""
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    B, T = q.shape[:2]
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    o, _ = chunk_gated_delta_rule(*flat[:3], flat[3].float(), flat[4].to(v.dtype), use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=_cu_seqlens(rows, B, T, q.device).long())
    return o.reshape(B, T, *o.shape[2:])
