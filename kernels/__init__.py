"""Ops the model and the losses ask for by name; each has a pure-torch reference in `kernels.reference`.

Backends (config key `kernels`):
  auto       the fused Triton op on CUDA wherever it measured faster than the eager reference
             (bench/RESULTS.md, "Fused kernels"; torch.compile of the reference beats us only on
             the linear-loss heads, by ≤ 1.26×, keeping 3× our memory), the reference elsewhere (CPU)
  reference  the torch path everywhere
  triton     every fused Triton op (tests use it on CPU under TRITON_INTERPRET=1)

Exceptions "auto" makes, from those measurements (H200, bf16, 16k tokens):
  rms_norm     with a trainable weight and rows < 1024 wide the Triton backward's dweight reduction
               lost to eager (1.29×); frozen weights (LoRA) or wide rows: Triton wins (0.39–0.48×)
  lora_linear  with dropout the Triton RNG kernel lost to torch dropout + cuBLAS (1.9× slower); the
               fused cuBLAS-accumulating path without dropout is 1.2–1.4× the frozen GEMM, PEFT 1.5–2×

Not an exception but a limit, on every backend ("triton" too): apply_rope with GLM's interleaved pairs
or partial rotary runs the reference; the Triton kernel rotates whole heads in halves only (not measured
on GPU: GLM layouts pay eager RoPE there).

Attention (config key `attention`), for packed rows: "sdpa" uses a dense document-causal bool mask;
"flex" a FlexAttention block mask (no T×T mask, other documents' blocks skipped). "auto" picks flex on
CUDA (1B LoRA SFT at 8 × 2048: 1.25× the tokens/s of the dense mask, less memory) and sdpa on CPU
(FlexAttention has no CPU backward).

Both are chosen for a block, `with kernels.using(backend, attention): ...` (the previous choice comes
back after it; tasks.cache.build_stage wraps every stage in the config's choice); outside one: auto, auto.
"""
from __future__ import annotations

import contextlib
import functools
import importlib
from typing import Iterator

import torch

from kernels import reference

BACKENDS = ("auto", "reference", "triton")
ATTENTION = ("auto", "sdpa", "flex")
_MODULES = {"rms_norm": "triton_rms_norm", "apply_rope": "triton_rope", "swiglu": "triton_swiglu",
            "lora_linear": "triton_lora_linear", "linear_cross_entropy": "triton_linear_loss",
            "linear_token_logprobs": "triton_linear_loss"}
_BACKEND, _ATTENTION = "auto", "auto"     # what the ops below dispatch on; set by use() / using()


def _use(backend: str, attention: str = "auto") -> None:
    global _BACKEND, _ATTENTION
    if backend not in BACKENDS:
        raise ValueError(f"kernels backend must be one of {BACKENDS}, got {backend!r}")
    if attention not in ATTENTION:
        raise ValueError(f"attention must be one of {ATTENTION}, got {attention!r}")
    _BACKEND, _ATTENTION = backend, attention


@contextlib.contextmanager
def using(backend: str, attention: str = "auto") -> Iterator[None]:
    """Dispatch op calls to `backend` / `attention` inside the block; the previous choice is back on exit,
    error or not.

    The choice is still process-wide while the block runs (every thread sees it), not per model.
    """
    previous = _BACKEND, _ATTENTION
    _use(backend, attention)
    try:
        yield
    finally:
        _use(*previous)


@functools.cache
def _triton_op(name: str):
    return getattr(importlib.import_module(f"kernels.{_MODULES[name]}"), name)


def _impl(name: str, t: torch.Tensor, fused_pays: bool = True):
    """`fused_pays`: False where "auto" measured the reference faster for these inputs (see above)."""
    if _BACKEND == "triton" or (_BACKEND == "auto" and t.is_cuda and fused_pays):
        return _triton_op(name)
    return getattr(reference, name)


def rms_norm(x, weight, eps):
    return _impl("rms_norm", x, fused_pays=not (weight.requires_grad and x.shape[-1] < 1024))(x, weight, eps)


def apply_rope(q, k, cos, sin, interleaved=False):
    # The Triton kernel rotates whole heads in halves (Llama/Qwen) only. GLM's interleaved pairs and partial
    # rotary (tables narrower than the head) take the reference on every backend, "triton" included: the
    # kernel would silently rotate the wrong pairs (interleaved) or refuse the shapes (partial).
    if interleaved or cos.shape[-1] != q.shape[-1]:
        return reference.apply_rope(q, k, cos, sin, interleaved)
    return _impl("apply_rope", q)(q, k, cos, sin)


def swiglu(gate, up):
    return _impl("swiglu", gate)(gate, up)


def lora_linear(x, weight, lora_a, lora_b, scale, dropout=0.0, training=False):
    impl = _impl("lora_linear", x, fused_pays=not (dropout > 0 and training))
    return impl(x, weight, lora_a, lora_b, scale, dropout, training)


def linear_cross_entropy(hidden, weight, labels, ignore_index=-100):
    return _impl("linear_cross_entropy", hidden)(hidden, weight, labels, ignore_index)


def linear_token_logprobs(hidden, weight, labels, ignore_index=-100):
    return _impl("linear_token_logprobs", hidden)(hidden, weight, labels, ignore_index)


rope_cos_sin = reference.rope_cos_sin


def document_causal_mask(doc_ids: torch.Tensor):
    """A mask object for `attention`: a dense bool mask, or a FlexAttention BlockMask ("flex" on CUDA)."""
    if _ATTENTION in ("flex", "auto") and doc_ids.is_cuda:
        from kernels import flex
        return flex.document_block_mask(doc_ids)
    return reference.document_causal_mask(doc_ids)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask) -> torch.Tensor:
    if mask is not None and not isinstance(mask, torch.Tensor):
        from kernels import flex
        return flex.attention(q, k, v, mask)
    return reference.attention(q, k, v, mask)
