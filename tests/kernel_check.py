"""What the kernel tests share: tests/kernels (CPU, Triton interpreter, odd shapes) and tests/gpu (CUDA,
real sizes, bf16) build their inputs and compare an op with its pure-torch reference the same way.

`check` runs the op on the inputs and the reference on higher-precision copies of them, and compares
every output, then — under the same upstream gradients — the gradient of every input that needs one.
Each test file keeps its own tolerance table (dtype → `Tol`); `device` says where tensors are drawn.
"""
from __future__ import annotations

import functools
from typing import Callable, NamedTuple, Sequence

import torch
import torch.nn.functional as F

from glm_lora.kernels import reference


class Tol(NamedTuple):
    """assert_close tolerances; `scaled`: atol is a fraction of the expected tensor's max |value|."""
    atol: float
    rtol: float
    scaled: bool = False


def leaf(*shape: int, dtype: torch.dtype, seed: int, scale: float = 1.0, mean: float = 0.0,
         requires_grad: bool = True, device: str | torch.device = "cpu") -> torch.Tensor:
    """mean + scale · N(0, 1), drawn in float64 on `device` from `seed`, then rounded to `dtype`."""
    t = torch.randn(*shape, generator=torch.Generator(device).manual_seed(seed), dtype=torch.float64, device=device)
    return (t * scale + mean).to(dtype).requires_grad_(requires_grad)


def upcast(*tensors: torch.Tensor, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    """Detached copies in `dtype` that need a gradient where the originals do (the reference's inputs)."""
    return [t.detach().to(dtype).requires_grad_(t.requires_grad) for t in tensors]


def cotangents(outs: Sequence[torch.Tensor], seed: int = 0) -> list[torch.Tensor]:
    """Random upstream gradients, one per output, in its dtype and on its device."""
    gen = torch.Generator(outs[0].device).manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64, device=o.device).to(o.dtype) for o in outs]


def grads(outs, inputs: Sequence[torch.Tensor], grad_outputs: Sequence[torch.Tensor] | None = None):
    """Gradients of `inputs` under `grad_outputs`, or under `cotangents(outs)`."""
    outs = _tuple(outs)
    return torch.autograd.grad(outs, inputs, cotangents(outs) if grad_outputs is None else grad_outputs)


def close(actual: torch.Tensor, expected: torch.Tensor, tol: Tol | tuple) -> None:
    """assert_close, dtypes and shapes included; a `scaled` tol multiplies atol by max |expected|."""
    atol, rtol, scaled = Tol(*tol)
    torch.testing.assert_close(actual, expected, rtol=rtol,
                               atol=atol * expected.abs().max().item() if scaled else atol)


def check(fn: Callable, ref_fn: Callable, inputs: Sequence[torch.Tensor], tol: Tol | tuple | dict, *,
          ref_dtype: torch.dtype = torch.float64, grad_outputs: Sequence[torch.Tensor] | None = None):
    """fn(*inputs) vs ref_fn on `ref_dtype` copies of the inputs, forward and backward.

    Outputs: the inputs' promoted dtype, the reference's shape, not all zero, close to the reference.
    Then the gradient of every input that needs one, under `grad_outputs` (else random cotangents):
    the input's dtype and shape, not all zero, close. `tol`: one Tol for both, or {"out": .., "grad": ..}.
    Returns (outputs, reference outputs), each a tuple.
    """
    out_tol, grad_tol = (tol["out"], tol["grad"]) if isinstance(tol, dict) else (tol, tol)
    outs = _tuple(fn(*inputs))
    ref_inputs = upcast(*inputs, dtype=ref_dtype)
    ref_outs = _tuple(ref_fn(*ref_inputs))
    dtype = functools.reduce(torch.promote_types, [t.dtype for t in inputs])
    assert len(outs) == len(ref_outs)
    for o, r in zip(outs, ref_outs):
        assert o.dtype == dtype and o.shape == r.shape and o.abs().sum() > 0
        close(o.to(r.dtype), r, out_tol)
    gs = cotangents(outs) if grad_outputs is None else grad_outputs
    wrt = [t for t in inputs if t.requires_grad]
    got = torch.autograd.grad(outs, wrt, gs)
    want = torch.autograd.grad(ref_outs, [t for t in ref_inputs if t.requires_grad], [g.to(ref_dtype) for g in gs])
    for g, r, t in zip(got, want, wrt):
        assert g.dtype == t.dtype and g.shape == t.shape and g.abs().sum() > 0
        close(g.to(r.dtype), r, grad_tol)
    return outs, ref_outs


def _tuple(outs) -> tuple:
    return outs if isinstance(outs, tuple) else (outs,)


# --- inputs and references the CPU and GPU tests of one op share -----------------------------------

def rope_projection(B: int, T: int, H: int, D: int, dtype: torch.dtype, seed: int,
                    device: str | torch.device = "cpu") -> torch.Tensor:
    """(B, H, T, D) transposed view of a (B, T, H, D) projection, as model.Attention produces."""
    t = leaf(B, T, H, D, dtype=dtype, seed=seed, requires_grad=False, device=device)
    return t.transpose(1, 2).requires_grad_(True)


def rope_tables(B: int, T: int, D: int, *, offset: int = 5, theta: float = 10000.0, interleaved: bool = False,
                device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """cos/sin (B, T, D) for positions that start `offset` × row later in each row, as with packing; D is the
    rotary dim (fewer than the head's for partial rotary)."""
    pos = torch.stack([torch.arange(T, device=device) + offset * b for b in range(B)])
    return reference.rope_cos_sin(pos, D, theta, interleaved)


def check_rope(apply_rope: Callable, q, k, cos, sin, tol: Tol | tuple, ref_dtype: torch.dtype = torch.float64,
               interleaved: bool = False) -> None:
    """`check` for a RoPE op, against the reference on the tables rounded to q's dtype (the numbers the
    reference multiplies by); the outputs rotate, and they and the input gradients are laid out heads-last
    ((B, T, H, D) memory), whatever the inputs' layout: attention keeps that layout, so the heads join
    back into (B, T, H·D) without a copy in forward and backward."""
    rounded = [t.to(q.dtype).to(ref_dtype) for t in (cos, sin)]
    outs, _ = check(lambda q, k: apply_rope(q, k, cos, sin, interleaved),
                    lambda q, k: reference.apply_rope(q, k, *rounded, interleaved), (q, k), tol, ref_dtype=ref_dtype)
    for o, x in zip(outs, (q, k)):
        assert o.transpose(1, 2).is_contiguous()
        assert not torch.equal(o, x)
    for g in grads(apply_rope(q, k, cos, sin, interleaved), (q, k)):
        assert g.transpose(1, 2).is_contiguous()


def lora_inputs(lead: tuple[int, ...], k: int, n: int, r: int, dtype: torch.dtype, seed: int = 0,
                device: str | torch.device = "cpu"):
    """x (*lead, k), frozen W (n, k), A (r, k), B (n, r) — non-zero, unlike at init, so the LoRA term
    matters — and an upstream gradient dy (*lead, n); one float64 stream from `seed`, rounded to dtype."""
    g = torch.Generator(device).manual_seed(seed)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64, device=device) * std).to(dtype)
    x = rnd(*lead, k).requires_grad_(True)
    w = rnd(n, k, std=k ** -0.5)
    a = rnd(r, k, std=k ** -0.5).requires_grad_(True)
    b = rnd(n, r, std=r ** -0.5).requires_grad_(True)
    return x, w, a, b, rnd(*lead, n)


def masked_lora_reference(x, w, a, b, scale: float, keep: torch.Tensor, p: float) -> torch.Tensor:
    """reference.lora_linear with F.dropout's random mask replaced by `keep` (rows × in bool)."""
    return F.linear(x, w) + scale * F.linear(F.linear(x * keep.view(x.shape) / (1 - p), a), b)


def sparse_index(B: int, T: int, K: int, seed: int, *, drop: float = 0.3, doc_ids: torch.Tensor | None = None,
                 device: str | torch.device = "cpu") -> torch.Tensor:
    """Random DSA indices (B, T, K) int64 for sparse attention: each query lists up to K distinct keys at or before it
    (in its document when `doc_ids` (B, T) is given), its own position always among them; about `drop` of the others
    are -1 instead, and each row is shuffled, so padding sits anywhere. Builds a T × T draw: test sizes only."""
    g = torch.Generator(device).manual_seed(seed)
    pos = torch.arange(T, device=device)
    allowed = (pos[None, :] <= pos[:, None])[None].expand(B, T, T)
    if doc_ids is not None:
        allowed = allowed & (doc_ids[:, :, None] == doc_ids[:, None, :])
    draw = torch.rand(B, T, T, generator=g, device=device)
    draw = draw.masked_fill(~allowed, -1.0).masked_fill(pos[None, :] == pos[:, None], 2.0)    # own key first
    values, index = draw.topk(min(K, T), dim=-1)
    keep = (values >= 0) & ((values > 1.0) | (torch.rand(values.shape, generator=g, device=device) >= drop))
    index = torch.where(keep, index, -1)
    if K > T:
        index = torch.cat([index, index.new_full((B, T, K - T), -1)], dim=-1)
    order = torch.rand(B, T, K, generator=g, device=device).argsort(dim=-1)
    return index.gather(-1, order)
