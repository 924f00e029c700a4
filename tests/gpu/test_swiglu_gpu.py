"""GPU only: Triton SwiGLU vs the reference at real sizes, bf16 and fp32, fwd + bwd."""
import pytest
import torch

from kernels import reference as ref
from kernels.triton_swiglu import swiglu

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# dtype -> (atol, rtol) against the reference on fp32 copies; the kernel computes in fp32, rounds once.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(16384, 5632), (8, 2048, 2048), (3, 1001)])
def test_swiglu_real_sizes(shape, dtype):
    gen = torch.Generator("cuda").manual_seed(0)
    gate = (4 * torch.randn(shape, device="cuda", generator=gen)).to(dtype).requires_grad_(True)
    up = torch.randn(shape, device="cuda", dtype=dtype, generator=gen).requires_grad_(True)
    out = swiglu(gate, up)
    rg, ru = (t.detach().float().requires_grad_(True) for t in (gate, up))
    expected = ref.swiglu(rg, ru)
    atol, rtol = TOL[dtype]
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), expected, atol=atol, rtol=rtol)
    dy = torch.randn(shape, device="cuda", dtype=dtype, generator=gen)
    grads = torch.autograd.grad(out, (gate, up), dy)
    ref_grads = torch.autograd.grad(expected, (rg, ru), dy.float())
    for g, e in zip(grads, ref_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), e, atol=atol, rtol=rtol)
