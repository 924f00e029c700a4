"""GPU only: Triton RoPE vs the reference at real sizes, bf16 and fp32, on transposed q/k views, fwd + bwd."""
import pytest
import torch

from kernels import reference as ref
from kernels.triton_rope import apply_rope

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# dtype -> (atol, rtol) against the reference on fp32 copies (tables rounded to dtype first, as the
# reference does); the kernel rounds once.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("H, Hkv, D", [(12, 12, 64), (32, 4, 64), (16, 4, 128)])
def test_rope_real_sizes(H, Hkv, D, dtype):
    B, T = 8, 2048
    gen = torch.Generator("cuda").manual_seed(0)
    q = torch.randn(B, T, H, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2).requires_grad_(True)
    k = torch.randn(B, T, Hkv, D, device="cuda", dtype=dtype, generator=gen).transpose(1, 2).requires_grad_(True)
    pos = torch.stack([torch.arange(T, device="cuda") + 97 * b for b in range(B)])
    cos, sin = ref.rope_cos_sin(pos, D, 10000.0)
    oq, ok = apply_rope(q, k, cos, sin)
    rq, rk = (t.detach().float().requires_grad_(True) for t in (q, k))
    eq, ek = ref.apply_rope(rq, rk, cos.to(dtype).float(), sin.to(dtype).float())
    atol, rtol = TOL[dtype]
    for o, e in ((oq, eq), (ok, ek)):
        assert o.dtype == dtype
        torch.testing.assert_close(o.float(), e, atol=atol, rtol=rtol)
    gq, gk = (torch.randn(o.shape, device="cuda", dtype=dtype, generator=gen) for o in (oq, ok))
    grads = torch.autograd.grad((oq, ok), (q, k), (gq, gk))
    ref_grads = torch.autograd.grad((eq, ek), (rq, rk), (gq.float(), gk.float()))
    for g, e in zip(grads, ref_grads):
        assert g.dtype == dtype
        torch.testing.assert_close(g.float(), e, atol=atol, rtol=rtol)
