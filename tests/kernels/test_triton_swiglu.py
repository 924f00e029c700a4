"""Triton SwiGLU vs the torch reference: forward and both gradients (interpreter on CPU)."""
import pytest
import torch

from glm_lora.kernels import reference as ref
from glm_lora.kernels.triton_swiglu import swiglu, swiglu_halves
from tests.kernel_check import check, leaf

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

# dtype -> (atol, rtol) against the reference run on float64 copies; the kernel computes in fp32
# and rounds once.
TOL = {torch.float32: (1e-6, 1e-5), torch.float16: (1e-4, 1e-3)}
DTYPES = list(TOL)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 37), (1, 2500), (4, 64)])
def test_swiglu_matches_reference(shape, dtype):
    # Gate scale 4 reaches the saturated tails of the sigmoid; 2500 elements span three programs.
    gate, up = leaf(*shape, dtype=dtype, seed=1, scale=4.0), leaf(*shape, dtype=dtype, seed=2)
    check(swiglu, ref.swiglu, (gate, up), TOL[dtype])


def test_swiglu_slices_of_fused_gate_up_projection():
    gate_up = leaf(5, 3, 2 * 45, dtype=torch.float32, seed=3, scale=3.0).detach()
    gate = gate_up[..., :45].requires_grad_(True)
    up = gate_up[..., 45:].requires_grad_(True)
    assert not gate.is_contiguous()
    check(swiglu, ref.swiglu, (gate, up), TOL[torch.float32])


def test_swiglu_saves_only_its_inputs():
    gate, up = leaf(4, 9, dtype=torch.float32, seed=4), leaf(4, 9, dtype=torch.float32, seed=5)
    saved = swiglu(gate, up).grad_fn.saved_tensors
    assert len(saved) == 2
    assert torch.equal(saved[0], gate) and torch.equal(saved[1], up)


def test_swiglu_rejects_mismatched_inputs():
    with pytest.raises(ValueError):
        swiglu(torch.ones(2, 8), torch.ones(2, 8, dtype=torch.float16))
    with pytest.raises(ValueError):
        swiglu(torch.ones(2, 8), torch.ones(8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 7, 2 * 37), (1, 2 * 1250), (4, 2 * 64)])
def test_swiglu_halves_matches_reference(shape, dtype):
    """[gate | up] from one GEMM read in place: forward and the one (…, 2I) gradient."""
    gate_up = leaf(*shape, dtype=dtype, seed=6, scale=4.0)
    check(swiglu_halves, ref.swiglu_halves, (gate_up,), TOL[dtype])


def test_swiglu_halves_saves_only_its_input_and_rejects_an_odd_width():
    gate_up = leaf(4, 18, dtype=torch.float32, seed=7)
    saved = swiglu_halves(gate_up).grad_fn.saved_tensors
    assert len(saved) == 1 and torch.equal(saved[0], gate_up)
    with pytest.raises(ValueError, match="even width"):
        swiglu_halves(leaf(4, 9, dtype=torch.float32, seed=8))
