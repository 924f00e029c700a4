"""GPU only: NF4 dequantisation (Triton) and the QLoRA linear at real sizes."""
import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.kernels import reference
from glm_lora.kernels.triton_nf4 import dequantize_nf4
from glm_lora.model.quant import quantize_nf4
from tests.kernel_check import Tol, check, lora_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def parts(q):
    return q.packed, q.absmax_codes, q.nested_absmax, q.offset, q.code, q.nested_code


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(4096, 4096), (11008, 4096), (3, 320)])
def test_dequantize_is_bit_exact_on_the_gpu(shape, dtype):
    w = (torch.randn(shape, device="cuda", generator=torch.Generator("cuda").manual_seed(0)) * 0.02).to(dtype)
    q = quantize_nf4(w)
    assert torch.equal(dequantize_nf4(*parts(q), dtype), reference.dequantize_nf4(*parts(q), dtype))


def test_quantising_on_the_gpu_gives_the_cpu_codes():
    w = torch.randn(2048, 2048, generator=torch.Generator().manual_seed(1)) * 0.02
    cpu, gpu = quantize_nf4(w), quantize_nf4(w.cuda())
    assert torch.equal(gpu.packed.cpu(), cpu.packed)
    # The mean of the scales (the offset) may round differently on the GPU (another reduction order, seen: one
    # ulp), and so may the nested scales; a scale near a tie between two 8-bit codes then takes the other
    # one (seen: 2 of 65536), so those blocks' weights differ by one 8-bit step of their scale (< 2%).
    torch.testing.assert_close(gpu.offset.cpu(), cpu.offset, atol=0, rtol=1e-6)
    torch.testing.assert_close(gpu.nested_absmax.cpu(), cpu.nested_absmax, atol=0, rtol=1e-6)
    differ = gpu.absmax_codes.cpu() != cpu.absmax_codes
    assert differ.float().mean() < 1e-3
    assert ((gpu.absmax_codes.cpu()[differ].int() - cpu.absmax_codes[differ].int()).abs() == 1).all()
    torch.testing.assert_close(gpu.dequantize().cpu(), cpu.dequantize(), atol=0, rtol=2e-2)


@pytest.mark.parametrize("lead,k,n,r", [((8, 2048), 2048, 5632, 16), ((4096,), 5632, 2048, 64)])
def test_qlora_linear_matches_reference_bf16(lead, k, n, r):
    x, w, a, b, dy = lora_inputs(lead, k, n, r, torch.bfloat16, device="cuda")
    q = quantize_nf4(w)
    wq = q.dequantize(torch.float32)
    check(lambda x, a, b: kernels.nf4_lora_linear(x, q, a, b, 2.0),
          lambda x, a, b: reference.lora_linear(x, wq, a, b, 2.0), (x, a, b), Tol(2e-2, 3e-2, scaled=True),
          ref_dtype=torch.float32, grad_outputs=(dy,))
