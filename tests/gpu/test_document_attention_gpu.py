"""GPU only: FlexAttention document-causal attention equals the dense-mask reference, fwd + bwd."""
import pytest
import torch

from glm_lora import kernels
from glm_lora.kernels import reference
from tests.kernel_check import close, leaf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("heads,kv_heads", [(8, 8), (8, 2)])
@pytest.mark.parametrize("shared_prompt", [False, True])
def test_flex_matches_dense_mask(dtype, atol, heads, kv_heads, shared_prompt):
    B, T, D = 2, 384, 64
    doc_ids = torch.zeros(B, T, dtype=torch.long, device="cuda")
    doc_ids[0, :100], doc_ids[0, 100:250], doc_ids[0, 250:370] = 1, 2, 3      # 370..383 padding
    doc_ids[1, :384] = 4
    prefix_docs = None
    if shared_prompt:      # data.packing's layout: doc 1 a prompt that docs 2 and 3 both see; row 1: 5 → 6, 7
        doc_ids[1, :70], doc_ids[1, 70:200], doc_ids[1, 200:300] = 5, 6, 7
        prefix_docs = torch.full_like(doc_ids, -1)
        prefix_docs[0, 100:370], prefix_docs[1, 70:300] = 1, 5
    q = leaf(B, heads, T, D, dtype=dtype, seed=0, device="cuda")
    k = leaf(B, kv_heads, T, D, dtype=dtype, seed=1, device="cuda")
    v = leaf(B, kv_heads, T, D, dtype=dtype, seed=2, device="cuda")
    g = leaf(B, heads, T, D, dtype=dtype, seed=3, requires_grad=False, device="cuda")
    with kernels.using("auto", "flex"):
        out = kernels.attention(q, k, v, kernels.document_causal_mask(doc_ids, prefix_docs))
    grads = torch.autograd.grad(out, (q, k, v), g)
    ref = reference.attention(q, k, v, reference.document_causal_mask(doc_ids, prefix_docs))
    ref_grads = torch.autograd.grad(ref, (q, k, v), g)
    real = (doc_ids > 0)[:, None, :, None]
    close(out * real, ref * real, (atol, atol))
    for a, b in zip(grads, ref_grads):
        close(a, b, (atol * 4, atol * 4))
