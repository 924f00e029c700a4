"""GPU only: LoRA over 4-bit routed experts (kernels.triton_grouped_mm.grouped_nf4_mm, in both NF4_EXPERTS modes: the
stack dequantised in one pass, or each weight tile in registers) at real MoE sizes, bf16 and fp16, against the reference (the stack dequantised into the same dtype, then
the per-expert loop in fp32), forward and every gradient; and the dequantised weights against the Triton
dequantisation kernel expert by expert (the same numbers, bit for bit)."""
import pytest
import torch

from glm_lora.kernels import reference
from glm_lora.kernels import triton_grouped_mm as tgm
from glm_lora.model.quant import NF4Params
from tests.gpu.test_grouped_mm_gpu import SHAPES, _inputs
from tests.kernel_check import Tol, check

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.bfloat16: Tol(1e-2, 2e-2, scaled=True), torch.float16: Tol(2e-3, 5e-3, scaled=True)}
NF4_SHAPES = [s for s in SHAPES if s != "odd"] + ["odd_blocks"]
SHAPES = {**SHAPES, "odd_blocks": (1000, 3, 7, 192, 300, 5)}       # 300 × 192: whole 64-blocks, odd tile edges


@pytest.mark.parametrize("mode", ["stack", "tile"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", NF4_SHAPES)
def test_lora_over_4bit_experts_matches_the_dequantised_loop(shape, dtype, mode, monkeypatch):
    import tests.gpu.test_grouped_mm_gpu as base
    monkeypatch.setattr(base, "SHAPES", SHAPES)
    monkeypatch.setattr(tgm, "NF4_EXPERTS", mode)
    x, w, a, b, offsets = _inputs(shape, dtype)
    stack = NF4Params.stacked(w.detach().unbind(0), w.shape[0]).stack()
    dequantised = reference.dequantize_nf4_stack(stack, dtype)
    check(lambda x, a, b: tgm.grouped_nf4_mm(x, stack, offsets, a, b, 2.0),
          lambda x, a, b: reference.grouped_lora_mm(x, dequantised.float(), a, b, 2.0, offsets),
          (x, a, b), TOL[dtype], ref_dtype=torch.float32)


def test_the_stack_dequantises_as_the_triton_kernel_does_per_expert():
    w = torch.randn(5, 1408, 2048, device="cuda", dtype=torch.bfloat16) * 0.02
    q = NF4Params.stacked(w.unbind(0), 5)
    whole = reference.dequantize_nf4_stack(q.stack(), torch.bfloat16)
    for e in range(5):
        assert torch.equal(whole[e], q.expert(e).dequantize())        # ops.dequantize_nf4: the Triton kernel on CUDA
