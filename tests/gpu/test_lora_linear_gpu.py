"""GPU only: the fused LoRA linear at real sizes (16384 rows, bf16) vs the reference in fp32.

Also: the Triton Philox mask equals its torch specification on the real compiler, and the forward
keeps no out-sized (M × out) or in-sized (M × in) tensor alive for backward.
"""
import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels import triton_lora_linear as tll
from kernels.triton_lora_linear import dropout_mask, dropout_seed, lora_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# dtype -> (atol as a fraction of the reference's max |value|, rtol), against an fp32/fp64 reference.
TOL = {torch.bfloat16: (1e-2, 2e-2), torch.float16: (2e-3, 5e-3), torch.float32: (1e-4, 1e-4)}
M, SCALE = 16384, 2.0
SHAPES = [(2048, 2048), (2048, 5632), (5632, 2048)]


def close(out, ref, dtype):
    atol, rtol = TOL[dtype]
    torch.testing.assert_close(out.to(ref.dtype), ref, atol=atol * ref.abs().max().item(), rtol=rtol)


def make(rows, k, n, r, dtype):
    g = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape, std=1.0):
        return (torch.randn(*shape, generator=g, device="cuda") * std).to(dtype)
    x = rnd(rows, k).requires_grad_(True)
    return x, rnd(n, k, std=k ** -0.5), rnd(r, k, std=k ** -0.5).requires_grad_(True), \
        rnd(n, r, std=r ** -0.5).requires_grad_(True), rnd(rows, n)


def check(x, w, a, b, dy, p, dtype, ref_dtype):
    rows, k = x.shape
    torch.manual_seed(1)
    keep = dropout_mask(dropout_seed("cuda"), rows, k, p) if p else torch.ones(rows, k, dtype=torch.bool, device="cuda")
    torch.manual_seed(1)
    out = lora_linear(x, w, a, b, SCALE, p, True)
    got = (out, *torch.autograd.grad(out, (x, a, b), dy))
    xr, wr, ar, br = (t.detach().to(ref_dtype).requires_grad_(t.requires_grad) for t in (x, w, a, b))
    ref_out = F.linear(xr, wr) + SCALE * F.linear(F.linear(xr * keep / (1 - p), ar), br)
    ref = (ref_out, *torch.autograd.grad(ref_out, (xr, ar, br), dy.to(ref_dtype)))
    for g_, e in zip(got, ref):
        close(g_, e, dtype)
    assert w.grad is None


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("r", [16, 64])
@pytest.mark.parametrize("k,n", SHAPES)
def test_bf16_real_shapes(k, n, r, p):
    check(*make(M, k, n, r, torch.bfloat16), p, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_fp16_with_dropout(dtype):
    # fp32 runs the kernels' "ieee" dots, fp16 the tf32 ones, and cuBLAS without TF32.
    check(*make(4096, 1000, 768, 16, dtype), 0.1, dtype, torch.float64)


@pytest.mark.parametrize("k", [2048, 5632, 1001])
def test_triton_mask_matches_torch_spec(k):
    x, _, a, _, _ = make(M, k, 8, 64, torch.bfloat16)
    seed = torch.tensor([(7 << 40) + 3], dtype=torch.int64, device="cuda")
    _, bits = tll.lora_down(x.detach(), a.detach(), seed, 0.1)
    assert torch.equal(bits, tll._pack_bits(dropout_mask(seed, M, k, 0.1)))


@pytest.mark.parametrize("k,n", SHAPES)
def test_no_big_tensor_saved_for_backward(k, n):
    x, w, a, b, _ = make(M, k, n, 64, torch.bfloat16)
    before = torch.cuda.memory_allocated()
    y = lora_linear(x, w, a, b, SCALE, 0.1, True)
    saved = torch.cuda.memory_allocated() - before - y.numel() * y.element_size()
    xa_and_bits = M * 64 * 2 + M * -(-k // 32) * 4
    assert saved <= xa_and_bits + 2**20, (saved, xa_and_bits)
    before = torch.cuda.memory_allocated()
    y_ref = reference.lora_linear(x, w, a, b, SCALE, 0.1, True)
    assert torch.cuda.memory_allocated() - before - y_ref.numel() * 2 > M * k * 2   # the reference keeps x⊙mask
