"""GPU only: sibling LoRA linears as one stacked op (kernels.lora_group) at real sizes (16384 rows, bf16 and
fp32) vs the reference (each sibling alone) in fp32 / fp64: q/k/v of the 1B shape (GQA) and gate/up."""
import pytest
import torch

from glm_lora.kernels import reference
from glm_lora.kernels.lora_group import lora_linear_group
from tests.kernel_check import Tol, check, leaf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.bfloat16: Tol(1e-2, 2e-2, scaled=True), torch.float32: Tol(1e-4, 1e-4, scaled=True)}
M, SCALE, R = 16384, 2.0, 64
GROUPS = {"qkv_1b": (2048, (2048, 1024, 1024)), "gate_up_1b": (2048, (5632, 5632)), "qkv_125m": (768, (768,) * 3)}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("group", list(GROUPS))
def test_matches_reference(group, dtype):
    k, outs = GROUPS[group]
    x = leaf(M, k, dtype=dtype, seed=0, device="cuda")
    ws = [leaf(n, k, dtype=dtype, seed=1 + i, scale=k ** -0.5, requires_grad=False, device="cuda")
          for i, n in enumerate(outs)]
    As = [leaf(R, k, dtype=dtype, seed=10 + i, scale=k ** -0.5, device="cuda") for i in range(len(outs))]
    Bs = [leaf(n, R, dtype=dtype, seed=20 + i, scale=R ** -0.5, device="cuda") for i, n in enumerate(outs)]
    n = len(outs)

    def op(fn):
        return lambda x, *t: fn(x, list(t[:n]), list(t[n:2 * n]), list(t[2 * n:]), SCALE)
    check(op(lora_linear_group), op(reference.lora_linear_group), (x, *ws, *As, *Bs), TOL[dtype],
          ref_dtype=torch.float32 if dtype == torch.bfloat16 else torch.float64)
