"""GPU only: Triton fused linear + loss heads at real size (bf16) vs the reference: values, grads, peak memory."""
import pytest
import torch

from glm_lora.kernels import reference as ref
from glm_lora.kernels import triton_linear_loss as tll
from tests.kernel_check import leaf

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

N, C, V = 16384, 2048, 32000
LOSS_RTOL = 1e-3        # fp32 sums over N tokens of fp32 NLLs from (possibly differently rounded) bf16 logits
GRAD_REL_ERR = 1e-2     # ‖a − b‖ / ‖b‖ for bf16 gradients


def rel_err(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def inputs(dtype, weight_grad, seed=0, shape=(N,)):
    h = leaf(*shape, C, dtype=dtype, seed=seed, device="cuda")
    w = leaf(V, C, dtype=dtype, seed=seed + 1, scale=0.02, requires_grad=weight_grad, device="cuda")
    gen = torch.Generator(device="cuda").manual_seed(seed + 2)
    labels = torch.randint(0, V, shape, device="cuda", generator=gen)
    labels[torch.rand(shape, device="cuda", generator=gen) < 0.3] = -100
    return h, w, labels


def run(fn, h, w, labels, g, autocast=False):
    """Forward + backward; returns (output, grads, peak bytes above what was allocated before)."""
    leaves = [t for t in (h, w) if t.requires_grad]
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        out = fn(h, w, labels)
    out = out[0] if isinstance(out, tuple) else out
    grads = torch.autograd.grad(out, leaves, g)
    torch.cuda.synchronize()
    return out.detach(), grads, torch.cuda.max_memory_allocated() - base


@pytest.mark.parametrize("weight_grad", [False, True])
def test_cross_entropy_bf16(weight_grad):
    h, w, labels = inputs(torch.bfloat16, weight_grad)
    g = torch.tensor(1.0 / (labels != -100).sum().item(), device="cuda")
    out, grads, mem = run(tll.linear_cross_entropy, h, w, labels, g)
    ref_out, ref_grads, ref_mem = run(ref.linear_cross_entropy, h, w, labels, g)
    assert out.dtype == ref_out.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, rtol=LOSS_RTOL, atol=0)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype and rel_err(a, b) < GRAD_REL_ERR
    assert mem < 0.4 * ref_mem, (mem / 2**20, ref_mem / 2**20)


def test_cross_entropy_autocast_fp32_leaves():
    """The LoRA training path: fp32 hidden, frozen fp32 lm_head, bf16 autocast."""
    h, w, labels = inputs(torch.float32, weight_grad=False)
    g = torch.tensor(1e-4, device="cuda")
    out, (gh,), mem = run(tll.linear_cross_entropy, h, w, labels, g, autocast=True)
    ref_out, (ref_gh,), ref_mem = run(ref.linear_cross_entropy, h, w, labels, g, autocast=True)
    torch.testing.assert_close(out, ref_out, rtol=LOSS_RTOL, atol=0)
    assert gh.dtype == torch.float32 and rel_err(gh, ref_gh) < GRAD_REL_ERR
    assert mem < 0.4 * ref_mem, (mem / 2**20, ref_mem / 2**20)


@pytest.mark.parametrize("weight_grad", [False, True])
def test_token_logprobs_bf16(weight_grad):
    h, w, labels = inputs(torch.bfloat16, weight_grad, shape=(8, N // 8))
    g = torch.randn(labels.shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    out, grads, mem = run(tll.linear_token_logprobs, h, w, labels, g)
    ref_out, ref_grads, ref_mem = run(ref.linear_token_logprobs, h, w, labels, g)
    assert out.dtype == ref_out.dtype == torch.float32
    torch.testing.assert_close(out, ref_out, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(out.sum(-1), ref_out.sum(-1), atol=0, rtol=LOSS_RTOL)
    for a, b in zip(grads, ref_grads):
        assert a.dtype == b.dtype and rel_err(a, b) < GRAD_REL_ERR
    assert mem < 0.4 * ref_mem, (mem / 2**20, ref_mem / 2**20)
