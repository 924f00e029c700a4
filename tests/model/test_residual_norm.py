"""The residual adds fused into the RMSNorms that read them (model.Block, kernels.add_rms_norm), and a norm handed to
a single matrix product in autocast's dtype: the same loss and gradients, bit for bit, as the plain composition
they replace (an add, then the norm in fp32, cast by autocast at each product). With several readers (siblings one
by one) the norm stays fp32, so their gradients are summed in fp32 as before; with one (stacked siblings) it is
written in bf16 and its one gradient arrives as the cast's would have."""
import pytest
import torch

from bench.workloads import norms_fused
from glm_lora.kernels import ops as kernels
from tests.kernels.test_lora_group import tiny_model


def _step(model, ids):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = model(ids).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["llama", "qwen3"])
@pytest.mark.parametrize("stack", [False, True])
def test_fused_residual_norms_give_the_same_bits(layout, stack, monkeypatch):
    monkeypatch.setitem(kernels.STACK_SIBLINGS, "cpu", stack)
    model = tiny_model(layout)
    ids = torch.randint(0, 50, (2, 16), generator=torch.Generator().manual_seed(1))
    fused_norm, seen = kernels.add_rms_norm, []
    monkeypatch.setattr(kernels, "add_rms_norm", lambda *a: seen.append(a[-1]) or fused_norm(*a))
    with kernels.using("auto"):
        fused = _step(model, ids)

    monkeypatch.setattr(kernels, "add_rms_norm", fused_norm)
    with kernels.using("auto"), norms_fused(False):
        plain = _step(model, ids)

    # every block's two norms but the first take the add; the final norm reads the last branch in fp32
    assert len(seen) == 2 * len(model.model.layers)
    assert set(seen[:-1]) == ({torch.bfloat16} if stack else {None}) and seen[-1] is None
    assert torch.equal(fused[0], plain[0])
    assert fused[1].keys() == plain[1].keys() and any("lora_A" in n for n in fused[1])
    for name in fused[1]:
        assert torch.equal(fused[1][name], plain[1][name]), name
