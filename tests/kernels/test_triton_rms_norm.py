"""Triton RMSNorm vs the torch reference: forward and every gradient (interpreter on CPU)."""
import functools

import pytest
import torch

from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_rms_norm import add_rms_norm, rms_norm
from tests.kernel_check import Tol, check, leaf

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

# dtype -> tolerances against the reference run on float64 copies of the inputs; gradient atols scale
# with the gradient's max |value|.
TOL = {torch.float32: dict(out=Tol(1e-5, 1e-5), grad=Tol(1e-5, 1e-5, scaled=True)),
       torch.float16: dict(out=Tol(4e-3, 4e-3), grad=Tol(4e-3, 4e-3, scaled=True))}
DTYPES = list(TOL)
EPS = 1e-5
norm, ref_norm = functools.partial(rms_norm, eps=EPS), functools.partial(ref.rms_norm, eps=EPS)


# Rows 5 and 13 leave the backward's last program short or empty; widths cover odd sizes and
# blocks up to 8192 (5000 pads to 8192).
SHAPES = [(3, 7, 48), (1, 5, 33), (13, 64), (2, 5000), (3, 8192)]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_rms_norm_matches_reference(shape, dtype):
    x = leaf(*shape, dtype=dtype, seed=1, scale=3.0)
    w = leaf(shape[-1], dtype=dtype, seed=2)
    check(norm, ref_norm, (x, w), TOL[dtype])


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
    check(norm, ref_norm, (x, w), TOL[torch.float32])


def test_rms_norm_non_contiguous_input():
    base = leaf(5, 3, 70, dtype=torch.float32, seed=7)
    x = base.transpose(0, 1)[..., 3:53]                     # row stride 70, batch dims permuted
    w = leaf(50, dtype=torch.float32, seed=8)
    check(norm, ref_norm, (x, w), TOL[torch.float32])


def test_rms_norm_uses_eps():
    x = torch.zeros(2, 8)
    x[0, 0] = 1e-3
    out = rms_norm(x, torch.ones(8), eps=1.0)
    assert out[0, 0].item() == pytest.approx(1e-3, rel=1e-3)
    assert torch.equal(out[1], torch.zeros(8))



# The residual stream's add fused into the norm (kernels.add_rms_norm): both outputs and every gradient, the sum's
# own incoming gradient included (it is added inside the backward kernel).
add_norm = functools.partial(add_rms_norm, eps=EPS)
ref_add_norm = functools.partial(ref.add_rms_norm, eps=EPS)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 48), (13, 64), (2, 5000)])
def test_add_rms_norm_matches_reference(shape, dtype):
    x = leaf(*shape, dtype=dtype, seed=11, scale=2.0)
    r = leaf(*shape, dtype=dtype, seed=12)
    w = leaf(shape[-1], dtype=dtype, seed=13)
    check(add_norm, ref_add_norm, (x, r, w), TOL[dtype])


@pytest.mark.parametrize("needs", ["x", "residual", "both"])
def test_add_rms_norm_gradients_for_partial_requires_grad(needs):
    # the first block's stream (embeddings) may need no gradient while its branch does, and vice versa
    x = leaf(6, 24, dtype=torch.float32, seed=14, requires_grad=needs != "residual")
    r = leaf(6, 24, dtype=torch.float32, seed=15, requires_grad=needs != "x")
    w = leaf(24, dtype=torch.float32, seed=16, requires_grad=False)
    check(add_norm, ref_add_norm, (x, r, w), TOL[torch.float32])


def _same_inputs(fn, ref_fn, inputs, **kw):
    """fn and ref_fn on the same inputs (not upcast copies): outputs and gradients, each in its own dtype."""
    outs, ref_outs = fn(*inputs, **kw), ref_fn(*inputs, **kw)
    outs, ref_outs = (outs,) if torch.is_tensor(outs) else outs, (ref_outs,) if torch.is_tensor(ref_outs) else ref_outs
    gs = [torch.randn(o.shape, generator=torch.Generator().manual_seed(9), dtype=torch.float64).to(o.dtype) for o in outs]
    wrt = [t for t in inputs if torch.is_tensor(t) and t.requires_grad]
    return outs, ref_outs, torch.autograd.grad(outs, wrt, gs), torch.autograd.grad(ref_outs, wrt, gs)


@pytest.mark.parametrize("add", [False, True])
def test_out_dtype_rounds_the_norm_as_autocast_would(add):
    """The model's case: an fp32 stream, a bf16 branch, the norm written in bf16 for the next matrix product —
    the values autocast's cast of the fp32 result would give, and gradients in each input's dtype."""
    x = leaf(5, 40, dtype=torch.float32, seed=17, scale=2.0)
    r = leaf(5, 40, dtype=torch.bfloat16, seed=18)
    w = leaf(40, dtype=torch.float32, seed=19, requires_grad=False)
    if add:
        fn, ref_fn, inputs = add_rms_norm, ref.add_rms_norm, (x, r, w, EPS)
    else:
        fn, ref_fn, inputs = rms_norm, ref.rms_norm, (x, w, EPS)
    outs, ref_outs, gs, ref_gs = _same_inputs(fn, ref_fn, inputs, out_dtype=torch.bfloat16)
    assert outs[-1].dtype == ref_outs[-1].dtype == torch.bfloat16
    unrounded = ref_fn(*inputs)
    unrounded = unrounded if torch.is_tensor(unrounded) else unrounded[-1]
    assert torch.equal(ref_outs[-1], unrounded.to(torch.bfloat16))      # the reference = autocast's cast
    for o, e in zip(outs, ref_outs):
        assert o.dtype == e.dtype
        torch.testing.assert_close(o, e, atol=1e-2 if o.dtype == torch.bfloat16 else 1e-5, rtol=1e-2)
    for g, e, t in zip(gs, ref_gs, (t for t in inputs if torch.is_tensor(t) and t.requires_grad)):
        assert g.dtype == e.dtype == t.dtype
        torch.testing.assert_close(g, e, atol=2e-2 if g.dtype == torch.bfloat16 else 1e-4, rtol=1e-2)
