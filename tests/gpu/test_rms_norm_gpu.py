"""GPU only: Triton RMSNorm / add+RMSNorm vs the reference at real sizes, bf16 and fp32, fwd + bwd."""
import pytest
import torch

from kernels import reference as ref
from kernels.triton_rms_norm import add_rms_norm, add_rms_norm_reference, rms_norm

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# dtype -> (atol, rtol) against the reference on fp32 copies; gradient atols scale with max |grad|.
TOL = {torch.float32: (1e-4, 1e-4), torch.bfloat16: (2e-2, 2e-2)}
EPS = 1e-5


def check(fn, ref_fn, inputs, dtype):
    gen = torch.Generator("cuda").manual_seed(0)
    outs = fn(*inputs)
    outs = outs if isinstance(outs, tuple) else (outs,)
    ref_inputs = [t.detach().float().requires_grad_(t.requires_grad) for t in inputs]
    ref_outs = ref_fn(*ref_inputs)
    ref_outs = ref_outs if isinstance(ref_outs, tuple) else (ref_outs,)
    atol, rtol = TOL[dtype]
    for o, r in zip(outs, ref_outs):
        assert o.dtype == dtype
        torch.testing.assert_close(o.float(), r, atol=atol, rtol=rtol)
    gs = [torch.randn(o.shape, device="cuda", dtype=dtype, generator=gen) for o in outs]
    wrt = [t for t in inputs if t.requires_grad]
    grads = torch.autograd.grad(outs, wrt, gs)
    ref_grads = torch.autograd.grad(ref_outs, [t for t in ref_inputs if t.requires_grad], [g.float() for g in gs])
    for g, r in zip(grads, ref_grads):
        assert g.dtype == dtype and g.abs().sum() > 0
        torch.testing.assert_close(g.float(), r, atol=atol * r.abs().max().item(), rtol=rtol)


def leaves(shape, dtype, n, seed=0):
    gen = torch.Generator("cuda").manual_seed(seed)
    return [torch.randn(shape, device="cuda", dtype=dtype, generator=gen).requires_grad_(True) for _ in range(n)]


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(16384, 2048), (16384, 4096), (8, 2048, 768), (64, 8192), (7, 5000)])
def test_rms_norm_real_sizes(shape, dtype):
    x, = leaves(shape, dtype, 1)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda", dtype=dtype)).requires_grad_(True)
    check(lambda x, w: rms_norm(x, w, EPS), lambda x, w: ref.rms_norm(x, w, EPS), (x, w), dtype)


@pytest.mark.parametrize("dtype", list(TOL))
def test_rms_norm_frozen_weight(dtype):
    x, = leaves((16384, 2048), dtype, 1)
    w = 1 + 0.1 * torch.randn(2048, device="cuda", dtype=dtype)
    check(lambda x, w: rms_norm(x, w, EPS), lambda x, w: ref.rms_norm(x, w, EPS), (x, w), dtype)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(16384, 2048), (8, 2048, 768)])
def test_add_rms_norm_real_sizes(shape, dtype):
    x, res = leaves(shape, dtype, 2)
    w = (1 + 0.1 * torch.randn(shape[-1], device="cuda", dtype=dtype)).requires_grad_(True)
    check(lambda x, r, w: add_rms_norm(x, r, w, EPS), lambda x, r, w: add_rms_norm_reference(x, r, w, EPS),
          (x, res, w), dtype)
