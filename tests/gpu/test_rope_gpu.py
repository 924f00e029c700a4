"""GPU only: Triton RoPE vs the reference at real sizes, bf16 and fp32, on transposed q/k views, fwd + bwd;
Llama/Qwen's halves and GLM's interleaved (partial) rotary."""
import pytest
import torch

from glm_lora.kernels.triton_rope import apply_rope
from tests.kernel_check import check_rope, rope_projection, rope_tables

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# dtype -> (atol, rtol) against the reference on fp32 copies (tables rounded to dtype first, as the
# reference does); the kernel rounds once.
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 1e-2)}


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("H, Hkv, D", [(12, 12, 64), (32, 4, 64), (16, 4, 128)])
def test_rope_real_sizes(H, Hkv, D, dtype):
    B, T = 8, 2048
    q = rope_projection(B, T, H, D, dtype, seed=0, device="cuda")
    k = rope_projection(B, T, Hkv, D, dtype, seed=1, device="cuda")
    check_rope(apply_rope, q, k, *rope_tables(B, T, D, offset=97, device="cuda"), TOL[dtype], ref_dtype=torch.float32)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("H, Hkv, D, R", [(32, 2, 128, 64), (16, 8, 128, 128)])
def test_rope_glm_layouts_real_sizes(H, Hkv, D, R, dtype):
    """GLM-4's interleaved pairs over half of each head (GLM-4-9B: 32 / 2 heads of 128), and over all of it."""
    B, T = 4, 2048
    q = rope_projection(B, T, H, D, dtype, seed=2, device="cuda")
    k = rope_projection(B, T, Hkv, D, dtype, seed=3, device="cuda")
    check_rope(apply_rope, q, k, *rope_tables(B, T, R, offset=97, interleaved=True, device="cuda"), TOL[dtype],
               ref_dtype=torch.float32, interleaved=True)
