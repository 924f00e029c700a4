"""Gated DeltaNet's kernels on CUDA from flash-linear-attention (PyPI `flash-linear-attention`, the field's library
for them; optional: `pip install flash-linear-attention`), for kernels/ops.py. Packed rows go in as one sequence
per document (cu_seqlens), so no document's state or convolution window reaches the next. The pure-torch
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


def cu_seqlens(doc_ids: torch.Tensor | None, B: int, T: int, device) -> torch.Tensor:
    """Where each sequence starts in the flattened (1, B·T) rows, and the end: rows, or documents within rows."""
    if doc_ids is None:
        return torch.arange(0, B * T + 1, T, device=device, dtype=torch.int32)
    starts = torch.ones_like(doc_ids, dtype=torch.bool)
    starts[:, 1:] = doc_ids[:, 1:] != doc_ids[:, :-1]
    first = torch.nonzero(starts.flatten()).flatten()
    return torch.cat([first, first.new_tensor([B * T])]).to(torch.int32)


def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, doc_ids: torch.Tensor | None) -> torch.Tensor:
    from fla.modules.causal_conv1d import causal_conv1d as conv
    B, T, D = x.shape
    y, _ = conv(x.reshape(1, B * T, D), weight.to(x.dtype), activation="silu",
                cu_seqlens=cu_seqlens(doc_ids, B, T, x.device))
    return y.reshape(B, T, D)


def gated_delta_rule(q, k, v, g, beta, doc_ids: torch.Tensor | None) -> torch.Tensor:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    B, T = q.shape[:2]
    flat = [t.reshape(1, B * T, *t.shape[2:]) for t in (q, k, v, g, beta)]
    o, _ = chunk_gated_delta_rule(*flat[:3], flat[3].float(), flat[4].to(v.dtype), use_qk_l2norm_in_kernel=True,
                                  cu_seqlens=cu_seqlens(doc_ids, B, T, q.device).long())
    return o.reshape(B, T, *o.shape[2:])
