"""Ops the model asks for by name. Each has a pure-torch reference in `kernels.reference`;
fused Triton versions register here for CUDA (see issue: fused kernels). `use(backend)`
switches globally; "reference" forces the torch path everywhere.
"""
from __future__ import annotations

from kernels import reference

_BACKEND = "auto"


def use(backend: str) -> None:
    global _BACKEND
    if backend not in ("auto", "reference"):
        raise ValueError(f"kernels backend must be 'auto' or 'reference', got {backend!r}")
    _BACKEND = backend


def backend() -> str:
    return _BACKEND


rms_norm = reference.rms_norm
rope_cos_sin = reference.rope_cos_sin
apply_rope = reference.apply_rope
swiglu = reference.swiglu
lora_linear = reference.lora_linear
linear_cross_entropy = reference.linear_cross_entropy
linear_token_logprobs = reference.linear_token_logprobs
