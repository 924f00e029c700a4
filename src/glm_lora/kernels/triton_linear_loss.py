"""Fused lm_head + loss heads, chunked over tokens so the full N×V logits never exist at once.

`linear_cross_entropy` computes its gradients during the forward (Liger-Kernel style): each logits
chunk is overwritten in place by d(loss)/d(logits) and folded into d_hidden (and into d_weight only
when the weight is trainable); backward just scales them. `linear_token_logprobs` has a per-token
upstream gradient, so it saves the per-token log-sum-exp and recomputes each logits chunk in backward.
The GEMMs are torch (cuBLAS); one Triton program per row does the softmax work in fp32 (fp64 for
fp64 logits), like the reference's upcast.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

_CHUNK_BYTES = 512 * 2**20      # budget for one chunk of logits
_MAX_BLOCK_V = 8192


@triton.jit
def _lse_kernel(logits_ptr, stride, labels_ptr, lse_ptr, nll_ptr, ignore_index, V,
                WRITE_GRAD: tl.constexpr, ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row: lse (online softmax) and nll = lse − x[label]; WRITE_GRAD: logits ← softmax − onehot."""
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride
    label = tl.load(labels_ptr + row)
    valid = label != ignore_index
    m = tl.full((), float("-inf"), ACC)
    d = tl.full((), 0.0, ACC)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + offs, mask=offs < V, other=float("-inf")).to(ACC)
        m_new = tl.maximum(m, tl.max(x, 0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), 0)
        m = m_new
    lse = m + tl.log(d)
    target = tl.load(ptr + label, mask=valid, other=0.0).to(ACC)
    tl.store(lse_ptr + row, lse)
    tl.store(nll_ptr + row, tl.where(valid, lse - target, 0.0))
    if WRITE_GRAD:
        for start in range(0, V, BLOCK_V):
            offs = start + tl.arange(0, BLOCK_V)
            mask = offs < V
            x = tl.load(ptr + offs, mask=mask, other=0.0).to(ACC)
            grad = tl.exp(x - lse) - (offs == label).to(ACC)
            grad = tl.where(valid, grad, 0.0)
            tl.store(ptr + offs, grad.to(logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _logprob_grad_kernel(logits_ptr, stride, labels_ptr, lse_ptr, grad_ptr, ignore_index, V,
                         ACC: tl.constexpr, BLOCK_V: tl.constexpr):
    """One row: logits ← g · (onehot − softmax), zero where the label is ignored."""
    row = tl.program_id(0).to(tl.int64)
    ptr = logits_ptr + row * stride
    label = tl.load(labels_ptr + row)
    g = tl.load(grad_ptr + row).to(ACC)
    g = tl.where(label != ignore_index, g, 0.0)
    lse = tl.load(lse_ptr + row).to(ACC)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        mask = offs < V
        x = tl.load(ptr + offs, mask=mask, other=0.0).to(ACC)
        grad = g * ((offs == label).to(ACC) - tl.exp(x - lse))
        tl.store(ptr + offs, grad.to(logits_ptr.dtype.element_ty), mask=mask)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _row_config(logits: torch.Tensor) -> dict:
    """Launch parameters for the row kernels on a (rows, V) logits chunk."""
    block = min(triton.next_power_of_2(logits.shape[1]), _MAX_BLOCK_V)
    acc = tl.float64 if logits.dtype == torch.float64 else tl.float32
    return dict(ACC=acc, BLOCK_V=block, num_warps=min(16, max(4, block // 512)))


def _lse(logits, labels, lse, nll, ignore_index, write_grad):
    """Per-row lse and NLL of a (rows, V) logits chunk; with write_grad, overwrite it with softmax − onehot."""
    _lse_kernel[(logits.shape[0],)](logits, logits.stride(0), labels, lse, nll, ignore_index, logits.shape[1],
                                    WRITE_GRAD=write_grad, **_row_config(logits))


def _logprob_grad(logits, labels, lse, grad, ignore_index):
    """Overwrite a (rows, V) logits chunk with d(log p(label))/d(logits) scaled by the per-row `grad`."""
    _logprob_grad_kernel[(logits.shape[0],)](logits, logits.stride(0), labels, lse, grad, ignore_index,
                                             logits.shape[1], **_row_config(logits))


def _compute_dtype(hidden: torch.Tensor, weight: torch.Tensor) -> torch.dtype:
    """The dtype F.linear(hidden, weight) would produce here, autocast included."""
    dev = hidden.device.type
    if torch.is_autocast_enabled(dev) and torch.float64 not in (hidden.dtype, weight.dtype):
        return torch.get_autocast_dtype(dev)
    return torch.promote_types(hidden.dtype, weight.dtype)


def _chunk_rows(n: int, v: int, dtype: torch.dtype) -> int:
    chunks = max(1, math.ceil(n * v * dtype.itemsize / _CHUNK_BYTES))
    return max(1, math.ceil(n / chunks))


def _prepare(hidden, weight, labels, chunk_size, cdt):
    """(N, C) hidden and (V, C) weight in the matmul dtype `cdt`, flat labels, rows per chunk."""
    h = hidden.reshape(-1, hidden.shape[-1]).to(cdt).contiguous()
    w = weight.to(cdt).contiguous()
    rows = chunk_size or _chunk_rows(h.shape[0], w.shape[0], cdt)
    return h, w, labels.reshape(-1).contiguous(), rows


def _grad_buffers(hidden, weight, need_dh, need_dw):
    dh = torch.empty(hidden.shape, dtype=hidden.dtype, device=hidden.device).view(-1, hidden.shape[-1]) if need_dh else None
    # d_weight sums over all chunks: accumulate half-precision weights' gradient in fp32.
    dw = torch.zeros(weight.shape, dtype=_acc_dtype(weight.dtype), device=weight.device) if need_dw else None
    return dh, dw


def _backprop_chunk(dlogits, h, w, s, e, dh, dw):
    """dh[s:e] = dlogits @ W; dW += dlogitsᵀ @ h[s:e] (each only if wanted)."""
    if dh is not None:
        dh[s:e] = dlogits @ w
    if dw is not None:
        if dw.dtype == dlogits.dtype:
            dw.addmm_(dlogits.t(), h[s:e])
        else:
            dw += dlogits.t() @ h[s:e]


def _forward_chunks(h, w, labels, rows, ignore_index, write_grad, each_chunk=None):
    """Per-row lse and NLL over `rows`-row logits chunks; `each_chunk(logits, s, e)` sees each chunk
    (overwritten by its gradient when write_grad) before the next one is computed."""
    n = h.shape[0]
    lse = torch.empty(n, dtype=_acc_dtype(h.dtype), device=h.device)
    nll = torch.empty_like(lse)
    for s in range(0, n, rows):
        e = min(s + rows, n)
        logits = h[s:e] @ w.t()
        _lse(logits, labels[s:e], lse[s:e], nll[s:e], ignore_index, write_grad)
        if each_chunk is not None:
            each_chunk(logits, s, e)
    return lse, nll


class LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size, grad_enabled):
        need_dh, need_dw = grad_enabled and ctx.needs_input_grad[0], grad_enabled and ctx.needs_input_grad[1]
        cdt = _compute_dtype(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, labels, rows = _prepare(hidden, weight, labels, chunk_size, cdt)
            dh, dw = _grad_buffers(hidden, weight, need_dh, need_dw)
            _, nll = _forward_chunks(h, w, labels, rows, ignore_index, need_dh or need_dw,
                                     lambda logits, s, e: _backprop_chunk(logits, h, w, s, e, dh, dw))
        ctx.save_for_backward(None if dh is None else dh.view(hidden.shape), None if dw is None else dw.to(weight.dtype))
        return nll.sum()

    @staticmethod
    def backward(ctx, grad):
        dh, dw = ctx.saved_tensors
        return (None if dh is None else dh * grad, None if dw is None else dw * grad, None, None, None, None)


class LinearTokenLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, labels, ignore_index, chunk_size):
        cdt = _compute_dtype(hidden, weight)
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, flat_labels, rows = _prepare(hidden, weight, labels, chunk_size, cdt)
            lse, nll = _forward_chunks(h, w, flat_labels, rows, ignore_index, False)
        ctx.save_for_backward(hidden, weight, labels, lse)
        ctx.ignore_index, ctx.chunk_size, ctx.cdt = ignore_index, chunk_size, cdt
        return (-nll).view(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels, lse = ctx.saved_tensors
        need_dh, need_dw = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        # Recompute the logits in the forward's matmul dtype, whatever autocast state backward runs in.
        with torch.autocast(hidden.device.type, enabled=False):
            h, w, flat_labels, rows = _prepare(hidden, weight, labels, ctx.chunk_size, ctx.cdt)
            g = grad.reshape(-1).contiguous()
            dh, dw = _grad_buffers(hidden, weight, need_dh, need_dw)
            n = h.shape[0]
            for s in range(0, n, rows):
                e = min(s + rows, n)
                logits = h[s:e] @ w.t()
                _logprob_grad(logits, flat_labels[s:e], lse[s:e], g[s:e], ctx.ignore_index)
                _backprop_chunk(logits, h, w, s, e, dh, dw)
        return (None if dh is None else dh.view(hidden.shape), None if dw is None else dw.to(weight.dtype),
                None, None, None)


def linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                         ignore_index: int = -100, *, chunk_size: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sum of token NLL over labelled positions and their count. hidden (N, C), labels (N,).

    `chunk_size` rows of logits exist at a time (default: about 512 MiB of them).
    """
    loss_sum = LinearCrossEntropy.apply(hidden, weight, labels, ignore_index, chunk_size, torch.is_grad_enabled())
    return loss_sum, (labels != ignore_index).sum()


def linear_token_logprobs(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor,
                          ignore_index: int = -100, *, chunk_size: int | None = None) -> torch.Tensor:
    """log p(label) per position (0 where label == ignore_index). hidden (B, T, C), labels (B, T)."""
    return LinearTokenLogprobs.apply(hidden, weight, labels, ignore_index, chunk_size)
