"""GPU only: DSA's Triton sparse attention at GLM-5-like sizes, bf16, against the masked-dense reference in fp32
(forward, dq, dk, dv), its memory (no T × T tensor), and the chunked indexer top-k against the dense formula."""
import pytest
import torch

from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_sparse_attention import sparse_attention
from tests.kernel_check import Tol, check, leaf, sparse_index

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# bf16 inputs, fp32 reference: the kernel rounds p and ds to bf16 before their dots and sums dk / dv over up to T
# queries in fp32 (atomics, any order)
TOL = {"out": Tol(1e-2, 2e-2, scaled=True), "grad": Tol(2e-2, 5e-2, scaled=True)}
T, K = 4096, 2048
# (Hq, Hkv, Dk, Dv): absorbed MLA (one 576-wide latent key, 512-wide value) at 16 and 64 heads; plain heads
SHAPES = {"absorbed_16": (16, 1, 576, 512), "absorbed_64": (64, 1, 576, 512), "plain_16": (16, 16, 128, 128)}


def inputs(Hq, Hkv, Dk, Dv, seed=0):
    q = leaf(1, Hq, T, Dk, dtype=torch.bfloat16, seed=seed, device="cuda")
    k = leaf(1, Hkv, T, Dk, dtype=torch.bfloat16, seed=seed + 1, device="cuda")
    v = leaf(1, Hkv, T, Dv, dtype=torch.bfloat16, seed=seed + 2, device="cuda")
    return q, k, v, sparse_index(1, T, K, seed=seed + 3, drop=0.1, device="cuda")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_sparse_attention_real_sizes(shape):
    Hq, Hkv, Dk, Dv = SHAPES[shape]
    q, k, v, index = inputs(Hq, Hkv, Dk, Dv)
    check(lambda q, k, v: sparse_attention(q, k, v, index, Dk ** -0.5),
          lambda q, k, v: ref.sparse_attention(q, k, v, index, Dk ** -0.5), (q, k, v), TOL, ref_dtype=torch.float32)


def test_sparse_attention_memory_is_t_by_k():
    """Forward + backward at 64 heads allocate about the output and dq (~0.6 GB), where the dense path's (Hq, T, T)
    fp32 scores alone take 4.3 GB."""
    q, k, v, index = inputs(*SHAPES["absorbed_64"])
    do = torch.randn(1, 64, T, 512, dtype=torch.bfloat16, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    torch.autograd.grad(sparse_attention(q, k, v, index, 576 ** -0.5), (q, k, v), do)
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    assert peak < 2 * (q.nbytes + do.nbytes)


def test_index_topk_real_sizes():
    """4096 tokens in 3 packed documents, 32 indexer heads of 128, top-2048: the chunked top-k's scores are the
    dense formula's (compared by score: ties may be ordered differently)."""
    B, H, D = 1, 32, 128
    q, k, w = (leaf(*s, dtype=torch.bfloat16, seed=50 + i, requires_grad=False, device="cuda")
               for i, s in enumerate([(B, T, H, D), (B, T, D), (B, T, H)]))
    doc_ids = torch.repeat_interleave(torch.arange(3, device="cuda"), torch.tensor([1000, 2500, 596], device="cuda"))[None]
    got = ref.index_topk(q, k, w, doc_ids, K, D ** -0.5, chunk=1000)
    scores = torch.nn.functional.relu(torch.matmul(q.float(), k.float().transpose(-1, -2).unsqueeze(1)) * D ** -0.5)
    dense = torch.matmul(w.float().unsqueeze(-2), scores).squeeze(-2)
    del scores
    dense = dense.masked_fill(~ref.document_causal_mask(doc_ids)[:, 0], float("-inf"))
    want = dense.topk(K, dim=-1).values
    assert torch.equal(got >= 0, want > float("-inf"))
    got_scores = dense.gather(-1, got.clamp(min=0)).masked_fill(got < 0, float("-inf"))
    torch.testing.assert_close(got_scores, want, rtol=1e-4, atol=1e-4)
