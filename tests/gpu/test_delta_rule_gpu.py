"""GPU only, with flash-linear-attention installed: gated DeltaNet's CUDA path (kernels/flash_linear.py, reached
through kernels.ops under backend "auto") equals the pure-torch reference (kernels/delta_rule.py, backend
"reference"): the chunked gated delta rule and the causal conv1d, forward and every input's gradient, fp32 and
bf16, odd lengths, packed rows (each document as if alone), value heads = 2× key heads; then a GatedDeltaNet layer
and a tiny Qwen3.5 Decoder, bf16 autocast, against the reference backend.

Errors are relative: ‖a − b‖ / ‖b‖ (METHOD.md). fla's fp32 dots run as tf32 (~3e-4 each, compounded over the
chunk recurrence); bf16 operands ~1e-2. The reference computes in fp32 whatever its inputs, on upcast copies here.
"""
import pytest
import torch
import torch.nn.functional as F

from glm_lora.kernels import flash_linear
from glm_lora.kernels.delta_rule import PackedRows
from glm_lora.kernels import ops as kernels

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
              pytest.mark.skipif(not flash_linear.available(), reason="needs flash-linear-attention (fla)")]

# relative error bounds (output, gradients) by the dtype of q, k, v / x
TOL = {torch.float32: (5e-3, 1e-2), torch.bfloat16: (2e-2, 4e-2)}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.detach().double(), b.detach().double()
    assert torch.isfinite(a).all(), "non-finite values"
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def assert_rel(a, b, tol, what):
    assert a.shape == b.shape, (what, a.shape, b.shape)
    err = rel(a, b)
    assert err <= tol, f"{what}: relative error {err:.2e} > {tol:.0e}"


def gen(seed):
    return torch.Generator("cuda").manual_seed(seed)


def delta_inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=0, slow_decay=False):
    """q, k (B, T, Hk, Dk) and v (B, T, Hv, Dv) in `dtype`; g (log decay ≤ 0) and beta in fp32, as GatedDeltaNet
    makes them (sigmoid of a projection; −exp(A_log)·softplus(a + dt_bias)). `slow_decay`: g near 0, so a state that
    leaked from one packed document into the next would stay large."""
    r = gen(seed)
    q, k = (torch.randn(B, T, Hk, Dk, generator=r, device="cuda").to(dtype).requires_grad_() for _ in range(2))
    v = torch.randn(B, T, Hv, Dv, generator=r, device="cuda").to(dtype).requires_grad_()
    a = torch.randn(B, T, Hv, generator=r, device="cuda")
    g = (-F.softplus(a) * (0.02 if slow_decay else 0.5)).requires_grad_()
    beta = torch.randn(B, T, Hv, generator=r, device="cuda").sigmoid().requires_grad_()
    return q, k, v, g, beta


def run_delta(backend, q, k, v, g, beta, doc_ids=None):
    """The op as GatedDeltaNet calls it: each key head repeated for its value heads (so the gradients of the
    Hk-head q, k sum over them)."""
    rep = v.shape[2] // q.shape[2]
    with kernels.using(backend, "sdpa"):
        return kernels.gated_delta_rule(q.repeat_interleave(rep, 2), k.repeat_interleave(rep, 2), v, g, beta,
                                        None if doc_ids is None else PackedRows(doc_ids))


def require_fla_backward():
    if not flash_linear.backward_ok():
        pytest.skip("fla refuses its gated backward on this GPU and Triton (Hopper, Triton < 3.7.1): training takes "
                    "the reference's there (kernels/flash_linear.py backward_ok)")


def grads_of(out, inputs, cot):
    return torch.autograd.grad(out, inputs, cot)


def upcast(*ts):
    return [t.detach().float().requires_grad_() for t in ts]


def packed_doc_ids(B, T, lengths_per_row):
    """doc_ids (B, T): the runs of each row's lengths numbered from 1 across rows, the rest padding (0)."""
    doc = torch.zeros(B, T, dtype=torch.long, device="cuda")
    n = 1
    for b, lengths in enumerate(lengths_per_row):
        s = 0
        for L in lengths:
            doc[b, s:s + L] = n
            n, s = n + 1, s + L
        assert s <= T
    return doc


# ---- the gated delta rule --------------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,Hk,Hv,Dk,Dv", [(2, 1000, 4, 4, 64, 64),       # T not a multiple of the chunk
                                              (1, 777, 2, 4, 128, 128),     # value heads 2× key heads (Qwen3.5-4B)
                                              (2, 64, 2, 2, 64, 128),       # one chunk exactly, Dk ≠ Dv
                                              (3, 5, 2, 2, 64, 64)])        # shorter than a chunk
def test_gated_delta_rule_matches_the_reference(dtype, B, T, Hk, Hv, Dk, Dv):
    q, k, v, g, beta = delta_inputs(B, T, Hk, Hv, Dk, Dv, dtype, seed=T)
    ref_in = upcast(q, k, v, g, beta)
    ref = run_delta("reference", *ref_in)
    out_tol, grad_tol = TOL[dtype]
    with torch.no_grad():                        # no gradient asked: fla's forward on every GPU
        assert_rel(run_delta("auto", q, k, v, g, beta).float(), ref, out_tol, "o (fla forward)")
    require_fla_backward()
    out = run_delta("auto", q, k, v, g, beta)
    assert out.dtype == dtype and out.shape == (B, T, Hv, Dv)
    assert_rel(out.float(), ref, out_tol, "o")
    cot = torch.randn(out.shape, generator=gen(1), device="cuda")
    got = grads_of(out, (q, k, v, g, beta), cot.to(dtype))
    want = grads_of(ref, ref_in, cot.to(dtype).float())
    for name, a, b, x in zip("q k v g beta".split(), got, want, (q, k, v, g, beta)):
        assert a.dtype == x.dtype and a.abs().sum() > 0, name
        assert_rel(a.float(), b, grad_tol * (2 if name == "g" else 1), f"d{name}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_packed_documents_each_run_as_if_alone(dtype):
    """Several documents a row (lengths 1, 63, 65, 130, …, and a padding tail): fla with cu_seqlens equals each
    document run alone (fla too), forward and backward, and equals the reference backend's packed path. Slow decay:
    a state leaking across a boundary would show."""
    B, T, Hk, Hv, D = 2, 600, 2, 4, 64
    lengths = [[1, 63, 65, 130, 300], [257, 200, 99]]          # row 0 ends with 41 padding tokens, row 1 with 44
    doc = packed_doc_ids(B, T, lengths)
    q, k, v, g, beta = delta_inputs(B, T, Hk, Hv, D, D, dtype, seed=7, slow_decay=True)
    with torch.no_grad():                        # fla's forward with cu_seqlens on every GPU: each document alone
        fwd = run_delta("auto", q, k, v, g, beta, doc)
        for b, row in enumerate(lengths):
            s = 0
            for L in row:
                alone = run_delta("auto", *(t[b:b + 1, s:s + L] for t in (q, k, v, g, beta)))
                assert_rel(fwd[b:b + 1, s:s + L].float(), alone.float(), 1e-3 if dtype == torch.float32 else 1e-2,
                           f"forward row {b} doc at {s} (len {L}) vs alone")
                s += L
    require_fla_backward()
    out = run_delta("auto", q, k, v, g, beta, doc)
    cot = torch.randn(out.shape, generator=gen(2), device="cuda").to(dtype)
    got = grads_of(out, (q, k, v, g, beta), cot)
    out_tol, grad_tol = TOL[dtype]
    for b, row in enumerate(lengths):
        s = 0
        for L in row:
            piece = [t[b:b + 1, s:s + L].detach().requires_grad_() for t in (q, k, v, g, beta)]
            alone = run_delta("auto", *piece)
            # the same kernel on the same document: only summation order may differ
            assert_rel(out[b:b + 1, s:s + L].float(), alone.float(), 1e-3 if dtype == torch.float32 else 1e-2,
                       f"row {b} doc at {s} (len {L}) vs alone")
            alone_grads = grads_of(alone, piece, cot[b:b + 1, s:s + L])
            for name, a, p in zip("q k v g beta".split(), alone_grads, got):
                assert_rel(p[b:b + 1, s:s + L].float(), a.float(), 2e-3 if dtype == torch.float32 else 2e-2,
                           f"d{name} row {b} doc at {s} vs alone")
            s += L
    ref_in = upcast(q, k, v, g, beta)
    ref = run_delta("reference", *ref_in, doc)
    real = (doc > 0)[:, :, None, None]
    assert_rel((out.float() * real), ref * real, out_tol, "packed o vs reference")
    want = grads_of(ref, ref_in, cot.float())
    for name, a, b_ in zip("q k v g beta".split(), got, want):
        assert_rel(a.float(), b_, grad_tol * (2 if name == "g" else 1), f"packed d{name} vs reference")


def test_a_leaking_state_would_be_caught():
    """The packed test's documents are not independent by accident: run as one sequence they differ."""
    B, T = 1, 256
    doc = packed_doc_ids(B, T, [[128, 128]])
    q, k, v, g, beta = delta_inputs(B, T, 2, 4, 64, 64, torch.float32, seed=3, slow_decay=True)
    with torch.no_grad():
        packed = run_delta("auto", q, k, v, g, beta, doc)
        joined = run_delta("auto", q, k, v, g, beta)
    assert rel(packed[:, 128:], joined[:, 128:]) > 0.1
    torch.testing.assert_close(packed[:, :128], joined[:, :128], atol=1e-4, rtol=1e-4)


# ---- the causal conv1d ---------------------------------------------------------------------------------------

def run_conv(backend, x, w, doc_ids=None):
    with kernels.using(backend, "sdpa"):
        return kernels.causal_conv1d(x, w, None if doc_ids is None else PackedRows(doc_ids))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("B,T,D,K", [(2, 1001, 768, 4), (1, 3, 64, 4), (2, 130, 200, 4)])
@pytest.mark.parametrize("packed", [False, True])
def test_causal_conv1d_matches_the_reference(dtype, B, T, D, K, packed):
    """x in `dtype`, the weight fp32 (a parameter of the model, cast to x's dtype by the CUDA path)."""
    r = gen(T + D)
    x = torch.randn(B, T, D, generator=r, device="cuda").to(dtype).requires_grad_()
    w = (torch.randn(D, K, generator=r, device="cuda") * K ** -0.5).requires_grad_()
    doc = None
    if packed:
        cuts = [[1, 2] + [T // 3] if T > 10 else [1, 2]] * B
        doc = packed_doc_ids(B, T, cuts)
    out = run_conv("auto", x, w, doc)
    xr, wr = upcast(x, w)
    ref = run_conv("reference", xr, wr, doc)
    assert out.dtype == dtype and out.shape == (B, T, D)
    out_tol, grad_tol = TOL[dtype]
    assert_rel(out.float(), ref, out_tol, "y")
    cot = torch.randn(out.shape, generator=gen(3), device="cuda").to(dtype)
    dx, dw = grads_of(out, (x, w), cot)
    rdx, rdw = grads_of(ref, (xr, wr), cot.float())
    assert dx.dtype == dtype and dw.dtype == torch.float32
    assert_rel(dx.float(), rdx, grad_tol, "dx")
    assert_rel(dw, rdw, grad_tol, "dweight")


def test_conv_window_restarts_at_each_document():
    B, T, D, K = 1, 40, 32, 4
    x = torch.randn(B, T, D, generator=gen(5), device="cuda")
    w = torch.randn(D, K, generator=gen(6), device="cuda")
    doc = packed_doc_ids(B, T, [[17, 23]])
    with torch.no_grad():
        packed = run_conv("auto", x, w, doc)
        alone = run_conv("auto", x[:, 17:], w)
    torch.testing.assert_close(packed[:, 17:], alone, atol=1e-5, rtol=1e-5)


# ---- a whole layer and a tiny Qwen3.5 ------------------------------------------------------------------------

def qwen35_config(**kw):
    from glm_lora.model import DecoderConfig
    base = dict(vocab_size=512, hidden_size=256, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64,
                intermediate_size=512, max_seq_len=1024, rms_norm_eps=1e-6, arch="qwen3_5_text",
                layer_types=("linear_attention", "linear_attention", "linear_attention", "full_attention"),
                linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=64, linear_value_head_dim=64)
    return DecoderConfig(**{**base, **kw})


def param_grads(module, loss):
    params = [p for p in module.parameters() if p.requires_grad]
    return dict(zip([n for n, p in module.named_parameters() if p.requires_grad], torch.autograd.grad(loss, params)))


def test_gated_deltanet_layer_bf16_matches_the_reference_backend():
    from glm_lora.model.delta_net import GatedDeltaNet
    torch.manual_seed(0)
    cfg = qwen35_config()
    layer = GatedDeltaNet(cfg, 0).cuda()
    x = torch.randn(2, 700, cfg.hidden_size, generator=gen(8), device="cuda").requires_grad_()
    doc = packed_doc_ids(2, 700, [[300, 1, 399], [700]])
    cot = torch.randn(2, 700, cfg.hidden_size, generator=gen(9), device="cuda")
    outs = {}
    for backend in ("auto", "reference"):
        with kernels.using(backend, "sdpa"), torch.autocast("cuda", dtype=torch.bfloat16):
            y = layer(x, PackedRows(doc))
        loss = (y.float() * cot).sum()
        outs[backend] = (y.float(), torch.autograd.grad(loss, x, retain_graph=True)[0], param_grads(layer, loss))
    (y, dx, dp), (ry, rdx, rdp) = outs["auto"], outs["reference"]
    assert_rel(y, ry, 2e-2, "layer output")
    assert_rel(dx, rdx, 4e-2, "layer dx")
    for name in rdp:
        assert_rel(dp[name], rdp[name], 5e-2, f"layer d{name}")


@pytest.mark.parametrize("lora", [False, True])
def test_tiny_qwen35_decoder_bf16_matches_the_reference_backend(lora):
    """Packed rows through the whole decoder (3 DeltaNet layers, 1 gated attention), bf16 autocast; with LoRA on
    every projection (the linear-attention ones included) only the adapter trains, as in the SFT bench."""
    from glm_lora.configs.schema import LoRAConfig
    from glm_lora.model import Decoder, inject_lora
    torch.manual_seed(0)
    cfg = qwen35_config()
    model = Decoder(cfg).cuda().train()
    if lora:
        # "all-linear": q/k/v/o, gate/up/down and the DeltaNet's in_proj_qkv/z/b/a and out_proj
        inject_lora(model, LoRAConfig(r=8, alpha=16, target_modules="all-linear"))
        with torch.no_grad():          # B = 0 at init: make the adapter matter
            for n, p in model.named_parameters():
                if p.requires_grad:
                    p.normal_(0, 0.05)
    B, T = 2, 512
    ids = torch.randint(0, cfg.vocab_size, (B, T), generator=gen(10), device="cuda")
    doc = packed_doc_ids(B, T, [[100, 250, 130], [512]])
    pos = torch.zeros_like(doc)
    for b in range(B):
        for d in doc[b].unique():
            m = doc[b] == d
            pos[b, m] = torch.arange(int(m.sum()), device="cuda")
    res = {}
    for backend in ("auto", "reference"):
        with kernels.using(backend, "sdpa"), torch.autocast("cuda", dtype=torch.bfloat16):
            logits = model(ids, pos, doc).float()
            loss = F.cross_entropy(logits.flatten(0, 1), ids.roll(-1, 1).flatten())
        res[backend] = (logits.detach(), loss.detach(), param_grads(model, loss))
    (lg, ls, gr), (rlg, rls, rgr) = res["auto"], res["reference"]
    real = (doc > 0)[..., None]
    assert_rel(lg * real, rlg * real, 2e-2, "logits")
    assert abs(float(ls - rls)) <= 1e-2 * abs(float(rls))
    assert gr.keys() == rgr.keys() and gr
    for name in rgr:
        assert_rel(gr[name], rgr[name], 6e-2, f"d{name}")
