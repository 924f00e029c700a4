"""GPU only: the fused LoRA linear at real sizes (16384 rows, bf16) vs the reference in fp32.

Also: the Triton Philox mask equals its torch specification on the real compiler, and the forward
keeps no out-sized (M × out) or in-sized (M × in) tensor alive for backward.
"""
import pytest
import torch

from glm_lora.kernels import reference
from glm_lora.kernels import triton_lora_linear as tll
from glm_lora.kernels.triton_lora_linear import dropout_mask, dropout_seed, lora_linear
from tests.kernel_check import Tol, check, lora_inputs, masked_lora_reference

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# dtype -> (atol as a fraction of the reference's max |value|, rtol), against an fp32/fp64 reference.
TOL = {torch.bfloat16: Tol(1e-2, 2e-2, scaled=True), torch.float16: Tol(2e-3, 5e-3, scaled=True),
       torch.float32: Tol(1e-4, 1e-4, scaled=True)}
M, SCALE = 16384, 2.0
SHAPES = [(2048, 2048), (2048, 5632), (5632, 2048)]


def make(rows, k, n, r, dtype):
    return lora_inputs((rows,), k, n, r, dtype, device="cuda")


def check_dropout(x, w, a, b, dy, p, dtype, ref_dtype):
    """Training-mode forward + backward with dropout p vs the reference with the same keep mask."""
    rows, k = x.shape
    torch.manual_seed(1)
    keep = dropout_mask(dropout_seed("cuda"), rows, k, p) if p else torch.ones(rows, k, dtype=torch.bool, device="cuda")
    torch.manual_seed(1)                                       # the same draw again, inside lora_linear
    check(lambda x, w, a, b: lora_linear(x, w, a, b, SCALE, p, True),
          lambda x, w, a, b: masked_lora_reference(x, w, a, b, SCALE, keep, p),
          (x, w, a, b), TOL[dtype], ref_dtype=ref_dtype, grad_outputs=(dy,))
    assert w.grad is None


@pytest.mark.parametrize("p", [0.0, 0.1])
@pytest.mark.parametrize("r", [16, 64])
@pytest.mark.parametrize("k,n", SHAPES)
def test_bf16_real_shapes(k, n, r, p):
    check_dropout(*make(M, k, n, r, torch.bfloat16), p, torch.bfloat16, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_fp32_fp16_with_dropout(dtype):
    # fp32 runs the kernels' "ieee" dots, fp16 the tf32 ones, and cuBLAS without TF32.
    check_dropout(*make(4096, 1000, 768, 16, dtype), 0.1, dtype, torch.float64)


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
