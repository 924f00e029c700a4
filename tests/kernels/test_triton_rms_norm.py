"""Triton RMSNorm / add+RMSNorm vs the torch reference: forward and every gradient (interpreter on CPU)."""
import pytest
import torch

from kernels import reference as ref
from kernels.triton_rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

# dtype -> (atol, rtol) against the reference run on float64 copies of the inputs.
TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (4e-3, 4e-3)}
DTYPES = list(TOL)
EPS = 1e-5


def leaf(*shape, dtype, seed, scale=1.0):
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64) * scale
    return t.to(dtype).requires_grad_(True)


def upcast(*ts):
    return [t.detach().double().requires_grad_(t.requires_grad) for t in ts]


def cotangents(outs, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=gen, dtype=torch.float64).to(o.dtype) for o in outs]


def check(fn, ref_fn, inputs, dtype):
    """fn(*inputs) vs ref_fn on float64 copies: every output and the gradient of every input that needs one."""
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ref_inputs = upcast(*inputs)
    ref_outs = ref_fn(*ref_inputs)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    atol, rtol = TOL[dtype]
    for o, r in zip(outs, ref_outs):
        assert o.abs().sum() > 0
        torch.testing.assert_close(o.double(), r, atol=atol, rtol=rtol)
    gs = cotangents(outs)
    wrt = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(outs, wrt, gs)
    ref_grads = torch.autograd.grad(ref_outs, [t for t in ref_inputs if t.requires_grad], [g.double() for g in gs])
    for g, r, t in zip(grads, ref_grads, wrt):
        assert g.dtype == t.dtype and g.shape == t.shape
        assert g.abs().sum() > 0
        torch.testing.assert_close(g.double(), r, atol=atol * r.abs().max().item(), rtol=rtol)


# Rows 5 and 13 leave the backward's last program short or empty; widths cover odd sizes and
# blocks up to 8192 (5000 pads to 8192).
SHAPES = [(3, 7, 48), (1, 5, 33), (13, 64), (2, 5000), (3, 8192)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape, dtype):
    x = leaf(*shape, dtype=dtype, seed=1, scale=3.0)
    w = leaf(shape[-1], dtype=dtype, seed=2)
    check(lambda x, w: rms_norm(x, w, EPS), lambda x, w: ref.rms_norm(x, w, EPS), (x, w), dtype)


def test_rms_norm_half_input_fp32_weight_promotes_like_reference():
    x = leaf(4, 40, dtype=torch.float16, seed=3)
    w = leaf(40, dtype=torch.float32, seed=4)
    out, expected = rms_norm(x, w, EPS), ref.rms_norm(x, w, EPS)
    assert out.dtype == expected.dtype == torch.float32
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    gx, gw = torch.autograd.grad(out, (x, w), torch.ones_like(out))
    rx, rw = torch.autograd.grad(expected, (x, w), torch.ones_like(expected))
    torch.testing.assert_close(gx, rx, atol=4e-3, rtol=4e-3)
    torch.testing.assert_close(gw, rw, atol=1e-4, rtol=1e-5)


@pytest.mark.parametrize("frozen", ["weight", "x"])
def test_rms_norm_gradients_for_partial_requires_grad(frozen):
    # LoRA freezes the norm weights; the first layer's input (embeddings) may need no gradient.
    x = leaf(6, 24, dtype=torch.float32, seed=5, scale=2.0).requires_grad_(frozen != "x")
    w = leaf(24, dtype=torch.float32, seed=6).requires_grad_(frozen != "weight")
    check(lambda x, w: rms_norm(x, w, EPS), lambda x, w: ref.rms_norm(x, w, EPS), (x, w), torch.float32)


def test_rms_norm_non_contiguous_input():
    base = leaf(5, 3, 70, dtype=torch.float32, seed=7)
    x = base.transpose(0, 1)[..., 3:53]                     # row stride 70, batch dims permuted
    w = leaf(50, dtype=torch.float32, seed=8)
    check(lambda x, w: rms_norm(x, w, EPS), lambda x, w: ref.rms_norm(x, w, EPS), (x, w), torch.float32)


def test_rms_norm_uses_eps():
    x = torch.zeros(2, 8)
    x[0, 0] = 1e-3
    out = rms_norm(x, torch.ones(8), eps=1.0)
    assert out[0, 0].item() == pytest.approx(1e-3, rel=1e-3)
    assert torch.equal(out[1], torch.zeros(8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(2, 7, 48), (5, 33)])
def test_add_rms_norm_matches_reference(shape, dtype):
    x = leaf(*shape, dtype=dtype, seed=9, scale=2.0)
    res = leaf(*shape, dtype=dtype, seed=10, scale=2.0)
    w = leaf(shape[-1], dtype=dtype, seed=11)
    check(lambda x, r, w: add_rms_norm(x, r, w, EPS), lambda x, r, w: add_rms_norm_reference(x, r, w, EPS),
          (x, res, w), dtype)


def test_add_rms_norm_frozen_weight():
    x, res = leaf(4, 20, dtype=torch.float32, seed=12), leaf(4, 20, dtype=torch.float32, seed=13)
    w = leaf(20, dtype=torch.float32, seed=14).requires_grad_(False)
    check(lambda x, r, w: add_rms_norm(x, r, w, EPS), lambda x, r, w: add_rms_norm_reference(x, r, w, EPS),
          (x, res, w), torch.float32)


def test_add_rms_norm_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        add_rms_norm(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.float16), torch.ones(8), EPS)
