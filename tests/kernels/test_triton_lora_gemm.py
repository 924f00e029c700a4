"""LoRA folded into the base GEMM (kernels.triton_lora_gemm) vs kernels.reference.lora_gemm, and the fused
LoRA linear with folding switched on vs kernels.reference.lora_linear (forward, dx, dA, dB). Triton interpreter
on CPU: odd shapes that cut every tile edge, W passed transposed (forward) and as it is (dx)."""
import pytest
import torch

from glm_lora.kernels import reference
from glm_lora.kernels import triton_lora_linear as tll
from glm_lora.kernels.triton_lora_gemm import MAX_RANK, lora_gemm
from tests.kernel_check import Tol, check, close, lora_inputs

torch.set_num_threads(1)

TOL = {torch.float32: Tol(1e-5, 1e-4, scaled=True), torch.float16: Tol(4e-3, 1e-2, scaled=True)}
# (M, K, N, R): rows, reduction, columns, rank — none a multiple of the 32-wide interpreter tiles
SHAPES = [(37, 70, 45, 5), (64, 33, 96, 16), (5, 130, 17, 64)]


def _operands(m, k, n, r, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)    # noqa: E731
    return rnd(m, k), rnd(n, k), rnd(m, r), rnd(n, r)          # x, W (out, in), P, B (out, r)


@pytest.mark.parametrize("m,k,n,r", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_forward_form_matches_reference(m, k, n, r, dtype):
    x, w, p, b = _operands(m, k, n, r, dtype)
    got = lora_gemm(x, w.t(), p, b.t(), 1.5)                 # strided Wᵀ and Bᵀ: no copies
    close(got.double(), reference.lora_gemm(x.double(), w.t().double(), p.double(), b.t().double(), 1.5), TOL[dtype])


@pytest.mark.parametrize("m,k,n,r", SHAPES)
def test_input_gradient_form_matches_reference(m, k, n, r):
    dy, w, dxa, a = _operands(m, n, k, r, torch.float32, seed=1)   # dy (m, out=n... as K), W (K, N)
    w = w.t().contiguous()                                          # (K=n, N=k): W as it is stored for dx
    a = a.t().contiguous()                                          # (R, N)
    got = lora_gemm(dy, w, dxa, a, 0.5)
    close(got, reference.lora_gemm(dy, w, dxa, a, 0.5), TOL[torch.float32])


def test_the_lora_term_is_really_added():
    x, w, p, b = _operands(40, 48, 40, 8, torch.float32)
    base = lora_gemm(x, w.t(), p, b.t(), 0.0)
    close(base, x @ w.t(), TOL[torch.float32])
    assert not torch.allclose(lora_gemm(x, w.t(), p, b.t(), 2.0), base, atol=1e-3)


def test_shapes_that_do_not_chain_or_a_rank_too_wide_are_refused():
    x, w, p, b = _operands(8, 16, 8, 4, torch.float32)
    with pytest.raises(ValueError, match="do not chain"):
        lora_gemm(x, w, p, b.t(), 1.0)
    wide = torch.zeros(8, MAX_RANK + 1)
    with pytest.raises(ValueError, match="rank"):
        lora_gemm(x, w.t(), wide, torch.zeros(MAX_RANK + 1, 8), 1.0)


@pytest.mark.parametrize("lead,k,n,r", [((2, 19), 50, 70, 3), ((33,), 64, 48, 16)])
def test_lora_linear_with_folding_matches_reference(monkeypatch, lead, k, n, r):
    calls = []
    monkeypatch.setattr(tll, "FOLD_INTO_GEMM", True)
    monkeypatch.setattr(tll, "lora_gemm", lambda *args: calls.append(args[0].shape) or lora_gemm(*args))
    x, w, a, b, dy = lora_inputs(lead, k, n, r, torch.float32)
    fn = lambda x, w, a, b: tll.lora_linear(x, w, a, b, 2.0)               # noqa: E731
    ref = lambda x, w, a, b: reference.lora_linear(x, w, a, b, 2.0)        # noqa: E731
    check(fn, ref, [x, w, a, b], TOL[torch.float32], grad_outputs=[dy])
    rows = x.numel() // k
    assert calls == [(rows, k), (rows, n)]                                  # forward (x), then dx (dy)
