"""kernels.reference vs transformers' Llama pieces / explicit formulas: forward and every gradient."""
import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm, LlamaRotaryEmbedding, apply_rotary_pos_emb

from glm_lora.kernels import reference as ref
from tests.kernel_check import close, grads, leaf, upcast

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

# dtype -> (atol, rtol)
TOL = {torch.float32: (1e-5, 1e-5), torch.float64: (1e-10, 1e-10), torch.bfloat16: (2e-2, 2e-2)}
DTYPES = list(TOL)
# The loss heads always compute log-softmax in fp32 (the inputs' dtype only sets the matmul),
# so they are checked against a float64 reference with these tolerances.
LOSS_TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (3e-2, 3e-2)}
LOSS_DTYPES = list(LOSS_TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 48), (1, 5, 33), (13, 64)])
def test_rms_norm_matches_llama_rmsnorm(shape, dtype):
    x = leaf(*shape, dtype=dtype, seed=1, scale=3.0)
    w = leaf(shape[-1], dtype=dtype, seed=2)
    eps = 1e-5
    hf = LlamaRMSNorm(shape[-1], eps=eps).to(dtype)
    with torch.no_grad():
        hf.weight.copy_(w)
    ours = ref.rms_norm(x, w, eps)
    theirs = hf(x)
    close(ours, theirs, TOL[dtype])
    gx, gw = grads(ours, (x, w))
    hx, hw = grads(theirs, (x, hf.weight))
    close(gx, hx, TOL[dtype])
    close(gw, hw, TOL[dtype])


def test_rms_norm_uses_eps():
    x = torch.zeros(2, 8)
    x[0, 0] = 1e-3
    out = ref.rms_norm(x, torch.ones(8), eps=1.0)
    # rsqrt(mean(x²)+1) ≈ 1: tiny inputs are not blown up to unit RMS.
    assert out[0, 0].item() == pytest.approx(1e-3, rel=1e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("B, H, Hkv, T, D, theta", [(2, 4, 2, 7, 16, 10000.0), (1, 3, 3, 11, 6, 500.0)])
def test_rope_matches_llama_rotary(B, H, Hkv, T, D, theta, dtype):
    cfg = LlamaConfig(hidden_size=H * D, num_attention_heads=H, num_key_value_heads=Hkv, head_dim=D,
                      max_position_embeddings=64, rope_parameters={"rope_type": "default", "rope_theta": theta})
    rotary = LlamaRotaryEmbedding(cfg)
    # Non-contiguous, per-row different positions (as with packing / left offsets).
    pos = torch.stack([torch.arange(T) + 3 * b for b in range(B)])
    q = leaf(B, H, T, D, dtype=dtype, seed=3)
    k = leaf(B, Hkv, T, D, dtype=dtype, seed=4)

    cos, sin = ref.rope_cos_sin(pos, D, theta)
    hcos, hsin = rotary(q, pos)
    assert cos.shape == (B, T, D)
    assert cos.dtype == torch.float32       # tables stay fp32; apply_rope casts them to q's dtype
    close(cos.to(dtype), hcos, TOL[dtype])  # HF returns them already in x's dtype
    close(sin.to(dtype), hsin, TOL[dtype])

    oq, ok = ref.apply_rope(q, k, cos, sin)
    tq, tk = apply_rotary_pos_emb(q, k, cos.to(dtype), sin.to(dtype), unsqueeze_dim=1)
    close(oq, tq, TOL[dtype])
    close(ok, tk, TOL[dtype])
    g_ours = grads(oq.sum() + (ok * 2).sum() + oq.pow(2).sum(), (q, k))
    g_hf = grads(tq.sum() + (tk * 2).sum() + tq.pow(2).sum(), (q, k))
    for a, b in zip(g_ours, g_hf):
        close(a, b, TOL[dtype])


def test_rope_position_zero_is_identity_and_norm_preserving():
    q, k = torch.randn(1, 2, 5, 8), torch.randn(1, 1, 5, 8)
    cos, sin = ref.rope_cos_sin(torch.arange(5)[None], 8, 10000.0)
    oq, ok = ref.apply_rope(q, k, cos, sin)
    torch.testing.assert_close(oq[:, :, 0], q[:, :, 0])
    torch.testing.assert_close(oq.norm(dim=-1), q.norm(dim=-1))
    assert not torch.allclose(oq[:, :, 1:], q[:, :, 1:])


def test_swiglu_explicit():
    g, u = torch.randn(3, 5, 7), torch.randn(3, 5, 7)
    torch.testing.assert_close(ref.swiglu(g, u), g * torch.sigmoid(g) * u)


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
@pytest.mark.parametrize("N, C, V", [(17, 24, 123), (5, 8, 7)])
def test_linear_cross_entropy_matches_mean_ce(N, C, V, dtype):
    h = leaf(N, C, dtype=dtype, seed=5)
    w = leaf(V, C, dtype=dtype, seed=6, scale=0.5)
    labels = torch.randint(0, V, (N,), generator=torch.Generator().manual_seed(7))
    labels[::3] = -100
    loss_sum, count = ref.linear_cross_entropy(h, w, labels)
    assert count.item() == int((labels != -100).sum())
    assert loss_sum.dtype == torch.float32
    ours = loss_sum / count
    h64, w64 = upcast(h, w)
    theirs = F.cross_entropy(F.linear(h64, w64), labels, ignore_index=-100)
    close(ours.double(), theirs, LOSS_TOL[dtype])
    gh, gw = torch.autograd.grad(ours, (h, w))
    th, tw = torch.autograd.grad(theirs, (h64, w64))
    assert gh.dtype == dtype and gw.dtype == dtype
    close(gh.double(), th, LOSS_TOL[dtype])
    close(gw.double(), tw, LOSS_TOL[dtype])
    assert gh[::3].abs().max() == 0     # ignored rows get no gradient


def test_linear_cross_entropy_custom_ignore_index():
    h, w = torch.randn(4, 6), torch.randn(9, 6)
    labels = torch.tensor([1, 7, 7, 2])
    s, n = ref.linear_cross_entropy(h, w, labels, ignore_index=7)
    assert n.item() == 2
    torch.testing.assert_close(s, F.cross_entropy(h[[0, 3]] @ w.T, labels[[0, 3]], reduction="sum"))


@pytest.mark.parametrize("dtype", LOSS_DTYPES)
@pytest.mark.parametrize("B, T, C, V", [(3, 9, 16, 101), (1, 4, 5, 11)])
def test_linear_token_logprobs_matches_gather(B, T, C, V, dtype):
    h = leaf(B, T, C, dtype=dtype, seed=8)
    w = leaf(V, C, dtype=dtype, seed=9, scale=0.5)
    labels = torch.randint(0, V, (B, T), generator=torch.Generator().manual_seed(10))
    labels[:, -2:] = -100
    ours = ref.linear_token_logprobs(h, w, labels)
    assert ours.shape == (B, T) and ours.dtype == torch.float32

    h64, w64 = upcast(h, w)
    logp = torch.log_softmax(h64 @ w64.T, dim=-1)
    rows = []
    for b in range(B):
        rows.append(torch.stack([logp[b, t, labels[b, t]] if labels[b, t] != -100 else logp.new_zeros(())
                                 for t in range(T)]))
    theirs = torch.stack(rows)
    close(ours.double(), theirs, LOSS_TOL[dtype])
    assert (ours[:, -2:] == 0).all()

    g = torch.randn(B, T, generator=torch.Generator().manual_seed(0))
    gh, gw = torch.autograd.grad(ours, (h, w), g)
    th, tw = torch.autograd.grad(theirs, (h64, w64), g.double())
    close(gh.double(), th, LOSS_TOL[dtype])
    close(gw.double(), tw, LOSS_TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead, IN, OUT, r, scale", [((2, 5), 24, 40, 4, 2.0), ((7,), 13, 9, 1, 0.5)])
def test_lora_linear_matches_formula(lead, IN, OUT, r, scale, dtype):
    x = leaf(*lead, IN, dtype=dtype, seed=11)
    W = leaf(OUT, IN, dtype=dtype, seed=12)
    A = leaf(r, IN, dtype=dtype, seed=13)
    Bm = leaf(OUT, r, dtype=dtype, seed=14)
    ours = ref.lora_linear(x, W, A, Bm, scale)
    theirs = x @ W.T + scale * (x @ A.T) @ Bm.T
    close(ours, theirs, TOL[dtype])
    for a, b in zip(grads(ours, (x, W, A, Bm)), grads(theirs, (x, W, A, Bm))):
        close(a, b, TOL[dtype])


def test_lora_linear_dropout_only_on_adapter_path_and_only_in_training():
    x, W, A, Bm = torch.randn(4, 16), torch.randn(8, 16), torch.randn(2, 16), torch.randn(8, 2)
    plain = ref.lora_linear(x, W, A, Bm, 1.5)
    torch.testing.assert_close(ref.lora_linear(x, W, A, Bm, 1.5, dropout=0.5, training=False), plain)
    torch.manual_seed(0)
    y = ref.lora_linear(x, W, A, Bm, 1.5, dropout=0.5, training=True)
    torch.manual_seed(0)
    xd = F.dropout(x, 0.5, True)
    torch.testing.assert_close(y, x @ W.T + 1.5 * (xd @ A.T) @ Bm.T)
    assert not torch.allclose(y, plain)


@pytest.mark.parametrize("masked", [False, True])
def test_attention_under_cpu_autocast_runs_in_fp32(masked):
    """bf16 autocast on the CPU: attention's own arithmetic stays fp32 (its bf16 backward is slow there);
    the result is fp32 attention of the bf16 inputs, returned in bf16, with gradients to the inputs."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(2, s, 16, 8).bfloat16().requires_grad_() for s in (4, 2, 2))
    mask = ref.document_causal_mask(torch.tensor([[0] * 9 + [1] * 7] * 2)) if masked else None
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = ref.attention(q, k, v, mask)
    want = ref._attention(q.detach().float(), k.detach().float(), v.detach().float(), mask)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want.bfloat16().float(), rtol=0, atol=0)
    out.float().sum().backward()
    assert all(t.grad is not None and t.grad.dtype == torch.bfloat16 and t.grad.abs().sum() > 0 for t in (q, k, v))


@pytest.mark.parametrize("in_place", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masked_gqa_attention_matches_transformers_eager(dtype, in_place, monkeypatch):
    """Packed rows with grouped k/v heads (2 of 6) and the document mask: SDPA gets the 2 shared heads in place
    (enable_gqa; the CPU default, reference.GQA_WITH_MASK) or the heads repeated to 6 (CUDA's rule); either way
    the output and the q/k/v gradients are transformers' eager attention (repeat_kv, explicit softmax) under the
    same mask, computed in float64."""
    from transformers.models.llama.modeling_llama import repeat_kv
    monkeypatch.setitem(ref.GQA_WITH_MASK, "cpu", in_place)
    seen = []
    sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(ref.F, "scaled_dot_product_attention",
                        lambda q, k, v, **kw: seen.append((k.shape[1], kw["enable_gqa"])) or sdpa(q, k, v, **kw))
    q, k, v = (leaf(3, h, 20, 16, dtype=dtype, seed=s) for s, h in ((1, 6), (2, 2), (3, 2)))
    doc_ids = torch.tensor([[1] * 7 + [2] * 9 + [3] * 4, [1] * 20, [1] * 5 + [2] * 12 + [0] * 3])
    mask = ref.document_causal_mask(doc_ids)

    def eager(q, k, v):
        k, v = repeat_kv(k, 3), repeat_kv(v, 3)
        scores = (q @ k.transpose(-1, -2)) * q.shape[-1] ** -0.5
        return torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1) @ v

    out = ref._attention(q, k, v, mask)
    assert seen == [(2, True) if in_place else (6, False)]
    q64, k64, v64 = upcast(q, k, v)
    want = eager(q64, k64, v64)
    atol, rtol = TOL[dtype]
    close(out.double(), want, (atol, rtol))
    upstream = torch.randn(out.shape, generator=torch.Generator().manual_seed(4), dtype=torch.float64)
    for got, expected in zip(grads(out, (q, k, v), [upstream.to(dtype)]), grads(want, (q64, k64, v64), [upstream])):
        close(got.double(), expected, (atol, rtol))
