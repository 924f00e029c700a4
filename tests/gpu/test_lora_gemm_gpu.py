"""GPU only: the LoRA term folded into the base GEMM (kernels.triton_lora_gemm) at real sizes and odd ones, bf16
and fp16, through the autotuner's configs; and the LoRA linear with folding on vs the reference."""
import pytest
import torch

from glm_lora.kernels import reference
from glm_lora.kernels import triton_lora_linear as tll
from glm_lora.kernels.triton_lora_gemm import lora_gemm
from tests.kernel_check import Tol, check, close, lora_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

TOL = {torch.bfloat16: Tol(1e-2, 2e-2, scaled=True), torch.float16: Tol(2e-3, 5e-3, scaled=True)}
# (M, K, N, R): the 1B shapes at 16384 rows, and odd ones cutting every tile edge
SHAPES = [(16384, 2048, 5632, 64), (16384, 5632, 2048, 16), (4097, 2050, 1000, 7), (300, 96, 130, 128)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m,k,n,r", SHAPES)
def test_folded_gemm_matches_reference(m, k, n, r, dtype):
    g = torch.Generator("cuda").manual_seed(0)
    rnd = lambda *s, std=1.0: (torch.randn(*s, generator=g, device="cuda") * std).to(dtype)     # noqa: E731
    x, w, p, b = rnd(m, k), rnd(n, k, std=k ** -0.5), rnd(m, r), rnd(n, r, std=r ** -0.5)
    close(lora_gemm(x, w.t(), p, b.t(), 2.0).float(), reference.lora_gemm(x, w.t(), p, b.t(), 2.0).float(), TOL[dtype])
    wt = w.t().contiguous()                              # a row-major right operand, as W is in the dx form
    close(lora_gemm(x, wt, p, b.t(), 0.5).float(), reference.lora_gemm(x, wt, p, b.t(), 0.5).float(), TOL[dtype])


@pytest.mark.parametrize("k,n,r", [(2048, 5632, 64), (5632, 2048, 16), (2050, 1000, 7)])
def test_lora_linear_with_folding_matches_reference(monkeypatch, k, n, r):
    monkeypatch.setattr(tll, "FOLD_INTO_GEMM", True)
    x, w, a, b, dy = lora_inputs((4096,), k, n, r, torch.bfloat16, device="cuda")
    check(lambda x, w, a, b: tll.lora_linear(x, w, a, b, 2.0), lambda x, w, a, b: reference.lora_linear(x, w, a, b, 2.0),
          (x, w, a, b), TOL[torch.bfloat16], ref_dtype=torch.float32, grad_outputs=(dy,))

