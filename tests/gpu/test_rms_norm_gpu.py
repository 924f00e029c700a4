"""GPU only: Triton RMSNorm vs the reference at real sizes, bf16 and fp32, fwd + bwd."""
import functools

import pytest
import torch

from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_rms_norm import add_rms_norm, rms_norm
from tests.kernel_check import Tol, check, leaf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# dtype -> tolerances against the reference on fp32 copies; gradient atols scale with max |grad|.
TOL = {torch.float32: dict(out=Tol(1e-4, 1e-4), grad=Tol(1e-4, 1e-4, scaled=True)),
       torch.bfloat16: dict(out=Tol(2e-2, 2e-2), grad=Tol(2e-2, 2e-2, scaled=True))}
EPS = 1e-5
norm, ref_norm = functools.partial(rms_norm, eps=EPS), functools.partial(ref.rms_norm, eps=EPS)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(16384, 2048), (16384, 4096), (8, 2048, 768), (64, 8192), (7, 5000)])
def test_rms_norm_real_sizes(shape, dtype):
    x = leaf(*shape, dtype=dtype, seed=0, device="cuda")
    w = leaf(shape[-1], dtype=dtype, seed=1, mean=1.0, scale=0.1, device="cuda")
    check(norm, ref_norm, (x, w), TOL[dtype], ref_dtype=torch.float32)


@pytest.mark.parametrize("dtype", list(TOL))
def test_rms_norm_frozen_weight(dtype):
    x = leaf(16384, 2048, dtype=dtype, seed=0, device="cuda")
    w = leaf(2048, dtype=dtype, seed=1, mean=1.0, scale=0.1, requires_grad=False, device="cuda")
    check(norm, ref_norm, (x, w), TOL[dtype], ref_dtype=torch.float32)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(16384, 2048), (8, 2048, 4096), (7, 5000)])
def test_add_rms_norm_real_sizes(shape, dtype):
    x = leaf(*shape, dtype=dtype, seed=0, device="cuda")
    r = leaf(*shape, dtype=dtype, seed=2, device="cuda")
    w = leaf(shape[-1], dtype=dtype, seed=1, mean=1.0, scale=0.1, requires_grad=False, device="cuda")
    check(functools.partial(add_rms_norm, eps=EPS), functools.partial(ref.add_rms_norm, eps=EPS), (x, r, w), TOL[dtype],
          ref_dtype=torch.float32)


def test_add_rms_norm_as_the_model_calls_it():
    """fp32 stream + bf16 branch, the norm written in bf16: the same values as the reference's add, norm and cast."""
    x = leaf(8, 2048, 2048, dtype=torch.float32, seed=0, device="cuda")
    r = leaf(8, 2048, 2048, dtype=torch.bfloat16, seed=2, device="cuda")
    w = leaf(2048, dtype=torch.float32, seed=1, mean=1.0, scale=0.1, requires_grad=False, device="cuda")
    s, y = add_rms_norm(x, r, w, EPS, torch.bfloat16)
    es, ey = ref.add_rms_norm(x, r, w, EPS, torch.bfloat16)
    assert y.dtype == torch.bfloat16 and s.dtype == torch.float32
    assert torch.equal(s, es)
    torch.testing.assert_close(y, ey, atol=2e-2, rtol=2e-2)
    gs, gy = torch.randn_like(s), torch.randn_like(y)
    got = torch.autograd.grad((s, y), (x, r), (gs, gy))
    want = torch.autograd.grad((es, ey), (x, r), (gs, gy))
    for g, e in zip(got, want):
        assert g.dtype == e.dtype
        torch.testing.assert_close(g, e, atol=2e-2 * e.abs().max().item(), rtol=2e-2)
