"""Triton RMSNorm vs the torch reference: forward and every gradient (interpreter on CPU)."""
import functools

import pytest
import torch

from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_rms_norm import rms_norm
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

