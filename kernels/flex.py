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


@functools.cache
def _compiled():
    return torch.compile(flex_attention, dynamic=False)


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask) -> torch.Tensor:
    return _compiled()(q, k, v, block_mask=mask, enable_gqa=k.shape[1] != q.shape[1])
