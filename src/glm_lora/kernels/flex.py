"""Document-causal attention on CUDA with FlexAttention block masks: no dense T×T mask, and
fully masked blocks (other documents) are skipped. Reference: kernels.reference.attention with
kernels.reference.document_causal_mask (tests compare the two on the GPU).
"""
from __future__ import annotations

import functools

import torch
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention


def document_block_mask(doc_ids: torch.Tensor, prefix_docs: torch.Tensor | None = None) -> BlockMask:
    B, T = doc_ids.shape

    def same_doc_causal(b, h, q, kv):
        return (doc_ids[b, q] == doc_ids[b, kv]) & (q >= kv)

    def or_shared_prompt(b, h, q, kv):
        return same_doc_causal(b, h, q, kv) | (prefix_docs[b, q] == doc_ids[b, kv])
    mask_mod = same_doc_causal if prefix_docs is None else or_shared_prompt
    return create_block_mask(mask_mod, B, None, T, T, device=doc_ids.device, _compile=True)


def _heads_last(q, k, v, block_mask, enable_gqa):
    return flex_attention(q, k, v, block_mask=block_mask, enable_gqa=enable_gqa).transpose(1, 2)


@functools.cache
def _compiled():
    return torch.compile(_heads_last, dynamic=False)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    """(B, H, T, D) like q, laid out (B, T, H, D). The compiled graph returns the (B, T, H, D) view: its
    gradient then arrives contiguous (the o-projection's input, reshaped), where a (B, H, T, D) output made
    AOTAutograd copy the incoming gradient to contiguous (B, H, T, D) in every layer's backward."""
    return _compiled()(q, k, v, mask, k.shape[1] != q.shape[1]).transpose(1, 2)
