"""Attention "auto": the FlexAttention-vs-dense-mask rule (kernels.flex_pays) and how it is applied."""
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference
from glm_lora.model import DecoderConfig


def test_rule_follows_the_measured_widths():
    # bench/RESULTS.md "Attention: FlexAttention vs the dense mask": 125M (12 × 64) the dense mask won or tied,
    # 1B (16 × 128) flex won; attention alone, flex won at head_dim 64 too, so the rule is the width
    small = DecoderConfig(vocab_size=32000, hidden_size=768, num_heads=12, num_kv_heads=12)
    large = DecoderConfig(vocab_size=32000, hidden_size=2048, num_heads=16, num_kv_heads=8)
    assert not kernels.flex_pays(small.num_heads, small.head_dim)
    assert kernels.flex_pays(large.num_heads, large.head_dim)
    assert kernels.flex_pays(32, 64) and kernels.flex_pays(32, 128)       # wide models, either head size
    assert not kernels.flex_pays(6, 128) and not kernels.flex_pays(12, 128)  # narrow ones (1536 wide): unmeasured, dense


def _doc_ids():
    return torch.tensor([[1, 1, 1, 2, 2, 0], [3, 3, 4, 4, 4, 4]])


def test_auto_mask_is_built_once_in_the_form_the_rule_picks(monkeypatch):
    from glm_lora.kernels import flex
    built = []
    monkeypatch.setattr(flex, "document_block_mask", lambda d, prefix=None: built.append(d) or "block-mask")
    narrow = kernels.AutoDocumentMask(_doc_ids())
    q = torch.zeros(2, 12, 6, 64)                                        # (B, H, T, D): 768 wide
    dense = narrow.resolve(q)
    assert isinstance(dense, torch.Tensor) and torch.equal(dense, reference.document_causal_mask(_doc_ids()))
    assert narrow.resolve(q) is dense and not built                      # shared by every layer, no block mask
    wide = kernels.AutoDocumentMask(_doc_ids())
    assert wide.resolve(torch.zeros(2, 16, 6, 128)) == "block-mask"
    assert wide.resolve(torch.zeros(2, 16, 6, 128)) == "block-mask" and len(built) == 1


def test_cpu_keeps_the_dense_mask_and_auto_attention_matches_reference():
    doc_ids = _doc_ids()
    with kernels.using("auto", "auto"):
        assert isinstance(kernels.document_causal_mask(doc_ids), torch.Tensor)     # FlexAttention: no CPU backward
    q, k, v = (torch.randn(2, 2, 6, 64, generator=torch.Generator().manual_seed(s)) for s in range(3))
    out = kernels.attention(q, k, v, kernels.AutoDocumentMask(doc_ids))
    ref = reference.attention(q, k, v, reference.document_causal_mask(doc_ids))
    assert torch.allclose(out, ref)


def test_flex_compiled_graph_returns_heads_last_so_its_gradient_needs_no_copy():
    """The compiled FlexAttention graph returns (B, T, H, D), contiguous: the gradient flowing back into it (the
    o-projection's input gradient) is then already in its output's layout, where a (B, H, T, D) output had
    AOTAutograd copy it to contiguous in every layer's backward (1B SFT on an H100: 16 copies a step). The
    caller still gets (B, H, T, D) with the dense reference's values. (CPU forward; the backward is GPU-tested.)"""
    import torch
    from glm_lora.kernels import flex, reference
    B, H, Hkv, T, D = 2, 4, 2, 128, 16
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, T, h, D, generator=gen).transpose(1, 2) for h in (H, Hkv, Hkv))
    doc = torch.cumsum((torch.rand(B, T, generator=gen) < 0.05).long(), 1)
    mask = flex.document_block_mask(doc)
    graph_out = flex._compiled()(q, k, v, mask, True)
    assert graph_out.shape == (B, T, H, D) and graph_out.is_contiguous()
    out = flex.attention(q, k, v, mask)
    torch.testing.assert_close(out, reference.attention(q, k, v, reference.document_causal_mask(doc)))


def test_varlen_sequences_are_the_documents_of_each_row():
    from glm_lora.kernels import varlen
    doc_ids = torch.tensor([[1, 1, 1, 2, 2, 0, 0], [2, 2, 5, 5, 5, 5, 0], [7, 7, 7, 7, 7, 7, 7]])
    docs = varlen.documents(doc_ids)
    # row 0: docs 1 | 2 | padding; row 1 starts a new sequence though it repeats row 0's id 2; row 2: one document
    assert docs.cu_seqlens.tolist() == [0, 3, 5, 7, 9, 13, 14, 21]
    assert docs.cu_seqlens.dtype == torch.int32 and docs.max_len == 7


def test_varlen_outside_bf16_takes_the_dense_mask_with_the_same_documents():
    from glm_lora.kernels import varlen
    doc_ids = _doc_ids()
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, h, 6, 8, generator=g) for h in (4, 2, 2))
    docs = varlen.documents(doc_ids)
    out = kernels.attention(q, k, v, docs)                              # fp32: FlashAttention has no fp32 kernels
    assert torch.equal(out, reference.attention(q, k, v, reference.document_causal_mask(doc_ids)))
    assert docs.dense_mask() is docs.dense_mask()                       # built once for every layer
    with kernels.using("auto", "varlen"):                               # and a CPU tensor gets the dense mask at once
        assert isinstance(kernels.document_causal_mask(doc_ids), torch.Tensor)


def test_a_mask_is_built_once_for_the_same_document_ids_and_again_when_they_change(monkeypatch):
    """DPO's policy and reference forwards over one batch share the block mask; new ids, ids edited in place,
    other shared prompts or another attention choice build a new one."""
    built = []
    monkeypatch.setattr(kernels, "_document_causal_mask", lambda d, p: built.append(d) or object())
    doc_ids, prefix = _doc_ids(), torch.full((2, 6), -1)
    first = kernels.document_causal_mask(doc_ids)
    assert kernels.document_causal_mask(doc_ids) is first and len(built) == 1
    assert kernels.document_causal_mask(doc_ids.clone()) is not first                 # equal values, new batch
    assert kernels.document_causal_mask(doc_ids) is not first                         # and back: rebuilt
    again = kernels.document_causal_mask(doc_ids)
    doc_ids[0, 0] = 2
    assert kernels.document_causal_mask(doc_ids) is not again                         # edited in place
    with_prefix = kernels.document_causal_mask(doc_ids, prefix)
    assert with_prefix is not again and kernels.document_causal_mask(doc_ids, prefix) is with_prefix
    with kernels.using("auto", "flex"):
        assert kernels.document_causal_mask(doc_ids, prefix) is not with_prefix
    assert len(built) == 6
