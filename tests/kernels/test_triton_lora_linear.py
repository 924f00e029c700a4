"""Fused LoRA linear (kernels.triton_lora_linear) vs kernels.reference.lora_linear: forward, dx, dA, dB.

Dropout: the kernels' keep mask is rebuilt with `dropout_mask` from the same torch RNG state and
fed to the reference formula; the Triton mask bits are checked bit-exactly against it.
"""
import pytest
import torch
import torch.nn.functional as F

from glm_lora.kernels import reference
from glm_lora.kernels import triton_lora_linear as tll
from glm_lora.kernels.triton_lora_linear import dropout_mask, dropout_seed, lora_linear
from tests.kernel_check import Tol, check, close, lora_inputs, masked_lora_reference, upcast

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

# dtype -> (atol as a fraction of the reference's max |value|, rtol), against a float64 reference.
TOL = {torch.float32: Tol(1e-5, 1e-4, scaled=True), torch.float16: Tol(4e-3, 1e-2, scaled=True),
       torch.bfloat16: Tol(2e-2, 3e-2, scaled=True)}
DTYPES = [torch.float32, torch.float16]
SCALE = 2.0
# (leading dims, in, out, r)
SHAPES = [((2, 5), 50, 70, 3), ((13,), 64, 48, 16), ((3, 1, 7), 33, 65, 8)]
# >= 129 rows (the dA reduction splits rows), in > BLOCK_K, in not a multiple of 4 or 32.
DROPOUT_SHAPES = [((2, 67), 50, 70, 3), ((130,), 130, 40, 16)]


def op(fn, **kw):
    """fn(x, w, a, b) at SCALE: the signature `check` calls, with W among the (frozen) inputs."""
    return lambda x, w, a, b: fn(x, w, a, b, SCALE, **kw)


def run(fn, x, w, a, b, dy, **kw):
    """Output and the gradients of the inputs that require grad (None for the others)."""
    out = fn(x, w, a, b, SCALE, **kw)
    inputs = [t for t in (x, a, b) if t.requires_grad]
    grads = iter(torch.autograd.grad(out, inputs, dy))
    return out, *(next(grads) if t.requires_grad else None for t in (x, a, b))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,k,n,r", SHAPES)
def test_matches_reference(lead, k, n, r, dtype):
    x, w, a, b, dy = lora_inputs(lead, k, n, r, dtype)
    (out,), (ref_out,) = check(op(lora_linear), op(reference.lora_linear), (x, w, a, b), TOL[dtype], grad_outputs=(dy,))
    assert out.shape == (*lead, n) and w.grad is None
    base = F.linear(*upcast(x, w))
    assert (ref_out - base).abs().max() > 50 * TOL[dtype].atol * ref_out.abs().max()   # the LoRA term is visible


def test_noncontiguous_x():
    x, w, a, b, dy = lora_inputs((2, 5), 50, 70, 3, torch.float32)
    x = torch.randn(5, 2, 100, dtype=torch.float32).transpose(0, 1)[..., ::2].requires_grad_(True)
    assert not x.is_contiguous()
    check(op(lora_linear), op(reference.lora_linear), (x, w, a, b), TOL[torch.float32], grad_outputs=(dy,))


def test_input_without_grad():
    x, w, a, b, dy = lora_inputs((2, 5), 50, 70, 3, torch.float32)
    x.requires_grad_(False)
    check(op(lora_linear), op(reference.lora_linear), (x, w, a, b), TOL[torch.float32], grad_outputs=(dy,))


def test_base_weight_must_be_frozen():
    x, w, a, b, dy = lora_inputs((2, 5), 50, 70, 3, torch.float32)
    w.requires_grad_(True)
    with pytest.raises(ValueError, match="freeze"):
        lora_linear(x, w, a, b, SCALE)
    with torch.no_grad():
        close(lora_linear(x, w, a, b, SCALE).double(), reference.lora_linear(*upcast(x, w, a, b), SCALE),
              TOL[torch.float32])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("lead,k,n,r", DROPOUT_SHAPES)
def test_dropout_matches_masked_reference(lead, k, n, r, dtype):
    p, rows = 0.3, torch.Size(lead).numel()
    x, w, a, b, dy = lora_inputs(lead, k, n, r, dtype)
    torch.manual_seed(7)
    keep = dropout_mask(dropout_seed("cpu"), rows, k, p)
    torch.manual_seed(7)                                        # the same draw again, inside lora_linear
    _, (ref_out,) = check(op(lora_linear, dropout=p, training=True),
                          lambda x, w, a, b: masked_lora_reference(x, w, a, b, SCALE, keep, p),
                          (x, w, a, b), TOL[dtype], grad_outputs=(dy,))
    no_dropout = reference.lora_linear(*upcast(x, w, a, b), SCALE)
    assert (ref_out - no_dropout).abs().max() > 50 * TOL[dtype].atol * ref_out.abs().max()   # the mask is visible
    assert w.grad is None


def test_dropout_rng_is_torch_driven():
    x, w, a, b, _ = lora_inputs((2, 67), 50, 70, 3, torch.float32)
    f = lambda: lora_linear(x, w, a, b, SCALE, 0.3, True).detach()   # noqa: E731
    torch.manual_seed(3)
    y1, y2 = f(), f()
    torch.manual_seed(3)
    assert torch.equal(f(), y1) and not torch.allclose(y1, y2)
    state = torch.get_rng_state()
    eval_out = lora_linear(x, w, a, b, SCALE, 0.3, False)
    assert torch.equal(torch.get_rng_state(), state)           # eval mode draws nothing
    torch.testing.assert_close(eval_out, lora_linear(x, w, a, b, SCALE))
    # p = 1 drops the whole LoRA branch, like F.dropout.
    close(lora_linear(x, w, a, b, SCALE, 1.0, True).double(), F.linear(*upcast(x, w)), TOL[torch.float32])


def test_dropout_mask_statistics():
    seed = torch.tensor([123456789012345], dtype=torch.int64)   # high 32 bits non-zero
    keep = dropout_mask(seed, 256, 257, 0.3)
    assert abs(keep.float().mean().item() - 0.7) < 0.01
    assert abs(keep[:, ::4].float().mean() - keep[:, 1::4].float().mean()) < 0.03   # the four Philox streams
    assert dropout_mask(seed, 8, 9, 0.0).all() and not dropout_mask(seed, 8, 9, 1.0).any()
    assert not torch.equal(keep, dropout_mask(seed + 1, 256, 257, 0.3))


@pytest.mark.parametrize("rows,cols", [(70, 130), (3, 31), (65, 256)])
def test_triton_mask_bits_match_torch(rows, cols):
    x = torch.randn(rows, cols)
    a = torch.randn(16, cols)
    seed = torch.tensor([(5 << 40) + 17], dtype=torch.int64)
    keep = dropout_mask(seed, rows, cols, 0.4)
    xa, bits = tll.lora_down(x, a, seed, 0.4)
    assert torch.equal(bits, tll._pack_bits(keep))
    assert torch.equal(tll._unpack_bits(bits, cols), keep)
    torch.testing.assert_close(xa, (x * keep) @ a.t() / 0.6, atol=1e-4, rtol=1e-4)
    xa, bits = tll.lora_down(x, a)                                 # the plain skinny GEMM
    assert bits is None
    torch.testing.assert_close(xa, x @ a.t(), atol=1e-4, rtol=1e-4)


def test_torch_path_matches_triton_path(monkeypatch):
    x, w, a, b, dy = lora_inputs((130,), 130, 40, 16, torch.float32)
    torch.manual_seed(11)
    triton_path = run(lora_linear, x, w, a, b, dy, dropout=0.2, training=True)
    monkeypatch.setattr(tll, "_INTERPRET", False)                  # CPU tensors now take the torch path
    torch.manual_seed(11)
    torch_path = run(lora_linear, x, w, a, b, dy, dropout=0.2, training=True)
    for g, e in zip(triton_path, torch_path):
        close(g, e, TOL[torch.float32])


@pytest.mark.parametrize("dropout", [0.0, 0.2])
def test_autocast_bf16(dropout):
    x, w, a, b, dy = lora_inputs((2, 67), 50, 70, 3, torch.float32)
    rows = x.shape[0] * x.shape[1]
    torch.manual_seed(5)
    keep = dropout_mask(dropout_seed("cpu"), rows, 50, dropout)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        torch.manual_seed(5)
        got = run(lora_linear, x, w, a, b, dy.bfloat16(), dropout=dropout, training=True)
    assert got[0].dtype == torch.bfloat16 and got[2].dtype == torch.float32 and got[1].dtype == torch.float32
    x64, w64, a64, b64, dy64 = upcast(x, w, a, b, dy.bfloat16())
    out = masked_lora_reference(x64, w64, a64, b64, SCALE, keep, dropout)
    ref = (out, *torch.autograd.grad(out, (x64, a64, b64), dy64))
    for g, e in zip(got, ref):
        close(g.double(), e, TOL[torch.bfloat16])
