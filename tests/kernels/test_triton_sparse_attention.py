"""DSA: the Triton sparse attention vs its masked-dense reference (forward, dq, dk, dv; interpreter on CPU), and the
chunked indexer top-k vs transformers' dense formula."""
import pytest
import torch
import torch.nn.functional as F

from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_sparse_attention import SparseAttentionFunction, sparse_attention, split_dk
from tests.kernel_check import Tol, check, leaf, rope_projection, sparse_index

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

# dtype -> tolerance against the reference on float64 copies; the kernel accumulates in fp32, rounds p and ds to the
# inputs' dtype before their dots (half precision: ~1e-3 relative), and sums dk / dv over queries in fp32.
TOL = {torch.float32: Tol(2e-5, 1e-4, scaled=True), torch.float16: Tol(5e-3, 1e-2, scaled=True),
       torch.bfloat16: Tol(3e-2, 5e-2, scaled=True)}


def qkv(B, Hq, Hkv, T, Dk, Dv, dtype, seed=0):
    return (leaf(B, Hq, T, Dk, dtype=dtype, seed=seed), leaf(B, Hkv, T, Dk, dtype=dtype, seed=seed + 1),
            leaf(B, Hkv, T, Dv, dtype=dtype, seed=seed + 2))


def check_sparse(q, k, v, index, scale, dtype):
    check(lambda q, k, v: sparse_attention(q, k, v, index, scale),
          lambda q, k, v: ref.sparse_attention(q, k, v, index, scale), (q, k, v), TOL[dtype])


# (B, Hq, Hkv, T, Dk, Dv, K): T = 1; absorbed (Hkv = 1) with odd Dk ≠ Dv and K not a multiple of BLOCK_K; plain
# Hkv = Hq over two key blocks; grouped heads with K > T; Dk split 32 + 16 around a 16-row head block.
SHAPES = [(1, 2, 1, 1, 16, 16, 4), (2, 4, 1, 7, 37, 20, 5), (1, 2, 2, 37, 24, 24, 19), (1, 6, 2, 9, 16, 8, 40),
          (1, 17, 1, 5, 40, 33, 6)]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "B{}-Hq{}-Hkv{}-T{}-Dk{}-Dv{}-K{}".format(*s))
def test_sparse_attention_matches_reference(shape):
    B, Hq, Hkv, T, Dk, Dv, K = shape
    index = sparse_index(B, T, K, seed=T)
    assert (index < 0).any() or T == 1
    q, k, v = qkv(B, Hq, Hkv, T, Dk, Dv, torch.float32)
    if T == 1:                  # one query over its one key: softmax ≡ 1, so dq ≡ dk ≡ 0 (nothing to compare)
        q.requires_grad_(False), k.requires_grad_(False)
    check_sparse(q, k, v, index, Dk ** -0.5, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_sparse_attention_half_precision(dtype):
    """fp16 runs the kernel's half dots; bf16 is upcast after each load in the interpreter (its bf16 dot is wrong)."""
    B, Hq, Hkv, T, Dk, Dv, K = 1, 4, 1, 11, 24, 16, 7
    check_sparse(*qkv(B, Hq, Hkv, T, Dk, Dv, dtype, seed=3), sparse_index(B, T, K, seed=4), 0.2, dtype)


def test_heads_last_inputs():
    """q, k, v as the model's projections give them: (B, H, T, D) views of (B, T, H, D) memory, read in place."""
    B, Hq, T, Dk, Dv, K = 2, 4, 6, 24, 16, 4
    q, k, v = (rope_projection(B, T, h, d, torch.float32, seed=i) for i, (h, d) in enumerate([(Hq, Dk), (1, Dk), (1, Dv)]))
    assert not q.is_contiguous()
    check_sparse(q, k, v, sparse_index(B, T, K, seed=3), 0.3, torch.float32)


def test_padding_blocks_before_any_key():
    """A whole block of -1 ahead of a query's keys: the online softmax's first blocks see no key (no NaN)."""
    B, T, K = 1, 5, 40
    index = torch.full((B, T, K), -1)
    index[..., 33:33 + T] = sparse_index(B, T, T, seed=5, drop=0.0)
    check_sparse(*qkv(B, 2, 1, T, 16, 16, torch.float32, seed=6), index, 0.25, torch.float32)


@pytest.mark.parametrize("heads", [(2, 1), (4, 4)])
def test_every_earlier_key_listed_is_dense_causal_attention(heads):
    """K ≥ T and every key at or before the query listed (in any order): plain causal attention."""
    (Hq, Hkv), B, T, D = heads, 1, 7, 16
    index = sparse_index(B, T, T + 3, seed=7, drop=0.0)
    assert ((index >= 0).sum(-1) == torch.arange(1, T + 1)).all()
    causal = ref.document_causal_mask(torch.ones(B, T, dtype=torch.long))
    inputs = qkv(B, Hq, Hkv, T, D, D, torch.float32, seed=8)
    for dense in (lambda q, k, v: ref.attention(q, k, v, None), lambda q, k, v: ref.attention(q, k, v, causal)):
        check(lambda q, k, v: sparse_attention(q, k, v, index, D ** -0.5), dense, inputs, TOL[torch.float32])


def test_gathered_reference_is_the_masked_dense_one():
    B, Hq, Hkv, T, Dk, Dv, K = 2, 4, 2, 9, 12, 10, 6
    index = sparse_index(B, T, K, seed=9)
    check(lambda q, k, v: ref.sparse_attention_gathered(q, k, v, index, 0.3),
          lambda q, k, v: ref.sparse_attention(q, k, v, index, 0.3),
          qkv(B, Hq, Hkv, T, Dk, Dv, torch.float64, seed=10), Tol(1e-12, 1e-10))


def test_packed_documents_through_the_indexer():
    """Indices from index_topk over packed documents never cross a document or look ahead; attention over them
    matches the reference."""
    B, T, H, D, K = 2, 13, 3, 8, 4
    doc_ids = torch.tensor([[1] * 5 + [2] * 6 + [3] * 2, [4] * 13])
    iq, ik, w = (leaf(*s, dtype=torch.float32, seed=i, requires_grad=False)
                 for i, s in enumerate([(B, T, H, D), (B, T, D), (B, T, H)]))
    index = ref.index_topk(iq, ik, w, doc_ids, K, D ** -0.5, chunk=4)
    valid = index >= 0
    keys = index.clamp(min=0)
    assert (keys <= torch.arange(T)[:, None]).all()
    assert (doc_ids.gather(1, keys.view(B, -1)).view(B, T, K) == doc_ids[..., None])[valid].all()
    assert valid.any(-1).all()
    start = torch.tensor([[0] * 5 + [5] * 6 + [11] * 2, [0] * 13])       # each token's document start
    assert (valid.sum(-1) == torch.minimum(torch.arange(T) - start + 1, torch.tensor(K))).all()
    check_sparse(*qkv(B, 4, 1, T, 16, 16, torch.float32, seed=11), index, 0.25, torch.float32)


def test_sparse_attention_saves_no_t_by_t_tensor():
    """O(T·K): what backward keeps is q, k, v, the index, the output and the log-sum-exp (B, Hq, T)."""
    B, Hq, T, D, K = 1, 2, 33, 16, 4
    q, k, v = qkv(B, Hq, 1, T, D, D, torch.float32, seed=12)
    out = sparse_attention(q, k, v, sparse_index(B, T, K, seed=13), 0.25)
    assert type(out.grad_fn).__name__ == SparseAttentionFunction.__name__ + "Backward"
    assert out.transpose(1, 2).is_contiguous()             # heads-last: joins into (B, T, Hq·Dv) without a copy
    assert max(t.numel() for t in out.grad_fn.saved_tensors) == q.numel() and q.numel() < T * T


def test_sparse_attention_dispatch():
    B, Hq, T, D, K = 1, 2, 6, 16, 3
    q, k, v = qkv(B, Hq, 1, T, D, D, torch.float32, seed=14)
    index = sparse_index(B, T, K, seed=15)
    with kernels.using("reference"):
        assert torch.equal(kernels.sparse_attention(q, k, v, index, 0.5), ref.sparse_attention(q, k, v, index, 0.5))
    with kernels.using("auto"):     # CPU: the reference
        assert kernels.sparse_attention(q, k, v, index, 0.5).grad_fn.name() != "SparseAttentionFunctionBackward"
    with kernels.using("triton"):
        assert type(kernels.sparse_attention(q, k, v, index, 0.5).grad_fn).__name__ == "SparseAttentionFunctionBackward"


def test_sparse_attention_rejects_bad_arguments():
    q, k, v = qkv(1, 3, 2, 4, 16, 16, torch.float32)          # 3 query heads over 2 kv heads
    index = sparse_index(1, 4, 2, seed=0)
    with pytest.raises(ValueError, match="multiple of Hkv"):
        sparse_attention(q, k, v, index, 1.0)
    q, k, v = qkv(1, 2, 1, 4, 16, 16, torch.float32)
    with pytest.raises(ValueError, match="index"):
        sparse_attention(q, k, v, index.float(), 1.0)
    with pytest.raises(ValueError, match="share a dtype"):
        sparse_attention(q, k.half(), v, index, 1.0)


@pytest.mark.parametrize("dk, split", [(576, (512, 64)), (256, (256, 0)), (192, (128, 64)), (37, (32, 16)),
                                       (8, (16, 0)), (130, (128, 16))])
def test_split_dk_into_power_of_two_dots(dk, split):
    assert split_dk(dk) == split


# --- the indexer's top-k ---------------------------------------------------------------------------------------

def dense_index_scores(q, k, weights, doc_ids, scale):
    """transformers' GlmMoeDsaIndexer.forward on the whole T × T: relu(q kᵀ · scale) in fp32, weights @ scores,
    -inf outside the causal (document) mask."""
    B, T = k.shape[:2]
    scores = F.relu(torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * scale)
    scores = torch.matmul(weights.float().unsqueeze(-2), scores).squeeze(-2)
    mask = ref.document_causal_mask(torch.ones(B, T, dtype=torch.long) if doc_ids is None else doc_ids)[:, 0]
    return scores.masked_fill(~mask, float("-inf"))


@pytest.mark.parametrize("chunk", [1, 4, 5, 13, 64, None])
@pytest.mark.parametrize("docs", [False, True])
@pytest.mark.parametrize("topk", [3, 8, 20])
def test_index_topk_matches_the_dense_formula(chunk, docs, topk):
    """Same top-k scores as the dense T × T computation, -1 exactly where it has -inf. Indices are compared by their
    scores: equal scores (relu's zeros) may be ordered differently (torch.topk's tie rule)."""
    B, T, H, D = 2, 13, 4, 8
    q, k, w = (leaf(*s, dtype=torch.bfloat16, seed=20 + i, requires_grad=False)
               for i, s in enumerate([(B, T, H, D), (B, T, D), (B, T, H)]))
    doc_ids = torch.tensor([[0] * 6 + [1] * 7, [2] * 3 + [3] * 4 + [4] * 6]) if docs else None
    got = ref.index_topk(q, k, w, doc_ids, topk, D ** -0.5, chunk=chunk)
    dense = dense_index_scores(q, k, w, doc_ids, D ** -0.5)
    want = dense.topk(min(topk, T), dim=-1).values
    assert got.shape == (B, T, min(topk, T)) and got.dtype == torch.int64
    assert torch.equal(got >= 0, want > float("-inf"))
    got_scores = dense.gather(-1, got.clamp(min=0)).masked_fill(got < 0, float("-inf"))
    torch.testing.assert_close(got_scores, want, rtol=1e-6, atol=1e-6)
    listed = got.masked_fill(got < 0, T).sort(-1).values                   # valid entries distinct
    assert ((listed[..., 1:] != listed[..., :-1]) | (listed[..., 1:] == T)).all()


def test_index_topk_one_token_and_frozen():
    q, k, w = leaf(1, 1, 2, 4, dtype=torch.float32, seed=30), leaf(1, 1, 4, dtype=torch.float32, seed=31), \
        leaf(1, 1, 2, dtype=torch.float32, seed=32)
    got = ref.index_topk(q, k, w, None, 2048, 0.5)
    assert got.tolist() == [[[0]]] and not got.requires_grad


def test_index_topk_default_chunk_bounds_the_scores(monkeypatch):
    """chunk None: as many query rows as keep the (B, chunk, H, T) fp32 scores under INDEX_CHUNK_BYTES."""
    B, T, H, D = 1, 10, 2, 4
    monkeypatch.setattr(ref, "INDEX_CHUNK_BYTES", 4 * B * H * T * 3)           # three rows a chunk
    q, k, w = (leaf(*s, dtype=torch.float32, seed=40 + i, requires_grad=False)
               for i, s in enumerate([(B, T, H, D), (B, T, D), (B, T, H)]))
    assert torch.equal(ref.index_topk(q, k, w, None, 4, 0.5), ref.index_topk(q, k, w, None, 4, 0.5, chunk=3))


def test_masked_dense_form_equals_the_reference():
    """kernels.ops.masked_dense_attention (SDPA over the scattered mask: "auto"'s CUDA path below
    SPARSE_KERNEL_MIN_KEYS) against the fp32 reference, forward and gradients, grouped and absorbed heads."""
    for Hq, Hkv, Dk, Dv in ((4, 1, 24, 16), (4, 4, 16, 16), (4, 2, 8, 12)):
        q, k, v = (leaf(2, h, 11, d, dtype=torch.float64, seed=i) for i, (h, d) in
                   enumerate(((Hq, Dk), (Hkv, Dk), (Hkv, Dv))))
        index = sparse_index(2, 11, 5, seed=3)
        check(lambda q, k, v: kernels.masked_dense_attention(q, k, v, index, 0.3),
              lambda q, k, v: ref.sparse_attention(q, k, v, index, 0.3), (q, k, v), (1e-10, 1e-10))
