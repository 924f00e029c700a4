"""Document-causal attention on CUDA through FlashAttention's variable-length kernels
(`torch.nn.attention.varlen`): each document of the packed rows is its own sequence, so no mask exists
and no tile of another document is computed. Documents only: a shared prompt (data.packing's
`prefix_docs`) is no sequence of its own, so those rows keep FlexAttention (kernels.document_causal_mask).
Reference: kernels.reference.attention with kernels.reference.document_causal_mask (GPU tests compare them).
"""
from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch

DTYPES = (torch.float16, torch.bfloat16)      # FlashAttention's; anything else takes the reference


@dataclass(eq=False)
class Documents:
    """The packed rows (B, T) as sequences: cu_seqlens (N + 1,) int32 over the flattened B·T tokens, the
    longest one's length, and the document ids they came from (for the reference path)."""
    cu_seqlens: torch.Tensor
    max_len: int
    doc_ids: torch.Tensor
    _dense: torch.Tensor | None = None

    def dense_mask(self) -> torch.Tensor:
        """The reference's document-causal mask of the same documents, built once and shared by every layer
        (inputs FlashAttention has no kernels for)."""
        if self._dense is None:
            from glm_lora.kernels import reference
            self._dense = reference.document_causal_mask(self.doc_ids)
        return self._dense


def documents(doc_ids: torch.Tensor) -> Documents:
    """A sequence starts at each row's start and wherever the document id changes (padding, id 0, is one
    more sequence: it attends to earlier padding only, as in the reference mask). One host sync."""
    B, T = doc_ids.shape
    flat = doc_ids.reshape(-1)
    starts = torch.ones_like(flat, dtype=torch.bool)
    starts[1:] = flat[1:] != flat[:-1]
    starts[::T] = True
    begin = starts.nonzero().squeeze(1)
    cu_seqlens = torch.cat([begin, begin.new_tensor([B * T])]).to(torch.int32)
    return Documents(cu_seqlens, int((cu_seqlens[1:] - cu_seqlens[:-1]).max()), doc_ids)


@functools.cache
def _causal_kwargs() -> dict:
    """varlen_attn's causal and grouped-head arguments, which torch has renamed between releases
    (`window_size=(-1, 0)` in 2.11 and 2.13, an `is_causal` flag where a release has that instead; `enable_gqa`
    where it exists (2.13) — without it, 2.11's kernels take fewer k/v heads as they are: the GPU test's 8 / 2
    heads pass on 2.11)."""
    from torch.nn.attention.varlen import varlen_attn
    params = inspect.signature(varlen_attn).parameters
    kwargs = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    if "enable_gqa" in params:
        kwargs["enable_gqa"] = True
    return kwargs


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: Documents) -> torch.Tensor:
    """q (B, H, T, D), k / v (B, Hkv, T, D), each laid out (B, T, H, D) as the model makes them (then the
    flattening below is a view); the output (B, H, T, D) laid out (B, T, H, D), as flex.attention's."""
    from torch.nn.attention.varlen import varlen_attn
    B, H, T, D = q.shape
    flat = [t.transpose(1, 2).reshape(B * T, t.shape[1], D) for t in (q, k, v)]
    out = varlen_attn(*flat, docs.cu_seqlens, docs.cu_seqlens, docs.max_len, docs.max_len, **_causal_kwargs())
    return out.view(B, T, H, D).transpose(1, 2)
