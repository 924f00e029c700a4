"""GPU only: FlexAttention and FlashAttention-varlen document-causal attention equal the dense-mask reference,
fwd + bwd (varlen: bf16; fp32 falls back to the dense mask, rows with shared prompts to flex)."""
import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference, varlen
from tests.kernel_check import close, leaf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("shared_prompt", [False, True])
@pytest.mark.parametrize("attention,heads_last", [("flex", False), ("varlen", False), ("varlen", True)])
def test_document_attention_matches_dense_mask(dtype, atol, heads, kv_heads, shared_prompt, attention, heads_last):
    B, T, D = 2, 384, 64
    doc_ids = torch.zeros(B, T, dtype=torch.long, device="cuda")
    doc_ids[0, :100], doc_ids[0, 100:250], doc_ids[0, 250:370] = 1, 2, 3      # 370..383 padding
    doc_ids[1, :384] = 4
    prefix_docs = None
    if shared_prompt:      # data.packing's layout: doc 1 a prompt that docs 2 and 3 both see; row 1: 5 → 6, 7
        doc_ids[1, :70], doc_ids[1, 70:200], doc_ids[1, 200:300] = 5, 6, 7
        prefix_docs = torch.full_like(doc_ids, -1)
        prefix_docs[0, 100:370], prefix_docs[1, 70:300] = 1, 5
    def make(h, seed, requires_grad=True):      # heads_last: (B, H, T, D) views of (B, T, H, D), as the model's
        if not heads_last:
            return leaf(B, h, T, D, dtype=dtype, seed=seed, requires_grad=requires_grad, device="cuda")
        t = leaf(B, T, h, D, dtype=dtype, seed=seed, requires_grad=False, device="cuda")
        return t.requires_grad_(requires_grad).transpose(1, 2)
    q, k, v = make(heads, 0), make(kv_heads, 1), make(kv_heads, 2)
    g = make(heads, 3, requires_grad=False)
    with kernels.using("auto", attention):
        mask = kernels.document_causal_mask(doc_ids, prefix_docs)
        out = kernels.attention(q, k, v, mask)
    if attention == "varlen":      # what each case really ran
        assert isinstance(mask, varlen.Documents) != shared_prompt
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = reference.attention(q, k, v, reference.document_causal_mask(doc_ids, prefix_docs))
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    real = (doc_ids > 0)[:, None, :, None]
    close(out * real, ref * real, (atol, atol))
    for a, b in zip(grads, ref_grads):
        close(a, b, (atol * 4, atol * 4))
