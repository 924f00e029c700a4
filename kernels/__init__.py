"""Ops the model asks for by name. Each has a pure-torch reference in `kernels.reference`.

Backends: "auto" picks the fastest measured implementation per op on the device (fused Triton
ops arrive with the kernels issue); "reference" forces the torch path everywhere; "flex" uses
FlexAttention block masks for packed (document-masked) attention on CUDA. Measured on the H200
(bench/RESULTS.md): for LoRA SFT at 8 × 2048 tokens the two were within run-to-run noise
(flex/dense 0.80–1.14×), so "auto" keeps the simpler dense mask; "flex" avoids the T×T mask's
memory at long sequence lengths.
"""
from __future__ import annotations

import torch

from kernels import reference

BACKENDS = ("auto", "reference", "flex")
_BACKEND = "auto"


def use(backend: str) -> None:
    global _BACKEND
    if backend not in BACKENDS:
        raise ValueError(f"kernels backend must be one of {BACKENDS}, got {backend!r}")
    _BACKEND = backend


def backend() -> str:
    return _BACKEND


def document_causal_mask(doc_ids: torch.Tensor):
    """A mask object for `attention`: a dense bool mask, or a FlexAttention BlockMask ("flex" on CUDA)."""
    if _BACKEND == "flex" and doc_ids.is_cuda:
        from kernels import flex
        return flex.document_block_mask(doc_ids)
    return reference.document_causal_mask(doc_ids)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    if mask is not None and not isinstance(mask, torch.Tensor):
        from kernels import flex
        return flex.attention(q, k, v, mask)
    return reference.attention(q, k, v, mask)


rms_norm = reference.rms_norm
rope_cos_sin = reference.rope_cos_sin
apply_rope = reference.apply_rope
swiglu = reference.swiglu
lora_linear = reference.lora_linear
linear_cross_entropy = reference.linear_cross_entropy
linear_token_logprobs = reference.linear_token_logprobs
