"""GPU only: Triton SwiGLU vs the reference at real sizes, bf16 and fp32, fwd + bwd."""
import pytest
import torch

from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_swiglu import swiglu, swiglu_halves
from tests.kernel_check import check, leaf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# dtype -> (atol, rtol) against the reference on fp32 copies; the kernel computes in fp32, rounds once.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(16384, 5632), (8, 2048, 2048), (3, 1001)])
def test_swiglu_real_sizes(shape, dtype):
    gate = leaf(*shape, dtype=dtype, seed=0, scale=4.0, device="cuda")
    up = leaf(*shape, dtype=dtype, seed=1, device="cuda")
    check(swiglu, ref.swiglu, (gate, up), TOL[dtype], ref_dtype=torch.float32)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("shape", [(16384, 2 * 5632), (8, 2048, 2 * 2048), (3, 2 * 1001)])
def test_swiglu_halves_real_sizes(shape, dtype):
    gate_up = leaf(*shape, dtype=dtype, seed=2, scale=4.0, device="cuda")
    check(swiglu_halves, ref.swiglu_halves, (gate_up,), TOL[dtype], ref_dtype=torch.float32)
