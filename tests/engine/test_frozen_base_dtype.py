"""A LoRA stage on CUDA under bf16/fp16 autocast holds the base's frozen GEMM weights in the compute dtype
(engine/adapter_stage.py): the same training step as fp32 frozen weights cast by autocast at every use, for
every layout, with the adapter, modules_to_save, norms and embeddings left in fp32. On the CPU the step runs
under CPU bf16 autocast (the same casts); on a GPU with the fused kernels as well."""
import copy

import pytest
import torch

from glm_lora.kernels import ops as kernels
from glm_lora.configs.schema import LoRAConfig
from glm_lora.engine.adapter_stage import _frozen_gemm_weights_in_compute_dtype
from glm_lora.engine.trainer import Runtime
from glm_lora.engine.losses import PreferenceLoss
from glm_lora.model.heads import causal_lm_loss
from glm_lora.model import inject_lora
from glm_lora.model.lora import LoRALinear
from tests.model.test_lora import LAYOUT_PROJECTIONS, VOCAB, randomise_b, tiny_arch

CUDA = torch.device("cuda")


def test_the_rule_cuda_half_precision():
    assert Runtime(CUDA, torch.bfloat16).weights_in_compute_dtype
    assert Runtime(CUDA, torch.float16).weights_in_compute_dtype
    assert Runtime(CUDA, torch.bfloat16, dist=object()).weights_in_compute_dtype   # FSDP2: bf16 shards (test_dist.py)
    assert not Runtime(CUDA, torch.float32).weights_in_compute_dtype
    assert not Runtime(torch.device("cpu"), torch.bfloat16).weights_in_compute_dtype   # CPU: fp32 master weights


def lora_model(arch: str):
    m = tiny_arch(arch).train()
    inject_lora(m, LoRAConfig(target_modules="all-linear", r=4, alpha=8, modules_to_save=["embed_tokens", "lm_head"]))
    randomise_b(m)
    return m


def test_a_dense_base_is_cast_and_everything_trainable_stays_fp32():
    m = lora_model("qwen3")
    assert _frozen_gemm_weights_in_compute_dtype(m, Runtime(CUDA, torch.bfloat16))    # the stage's runtime on a GPU
    for name, p in m.named_parameters():
        frozen_gemm = not p.requires_grad and name.endswith(".weight") and "norm" not in name
        assert p.dtype == (torch.bfloat16 if frozen_gemm else torch.float32), name
    assert all(mod.weight.dtype == torch.bfloat16 for mod in m.modules() if isinstance(mod, LoRALinear))
    cpu = lora_model("qwen3")
    assert not _frozen_gemm_weights_in_compute_dtype(cpu, Runtime(torch.device("cpu"), torch.bfloat16))
    assert all(p.dtype == torch.float32 for p in cpu.parameters())


def batch(device, seed=1, rows=2, T=24):
    """`rows` packed rows of two documents each (doc ids 1, 2 in row 0, 3, 4 in row 1, ...)."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (rows, T), generator=g)
    labels = ids.clone()
    labels[:, : T // 3] = -100
    labels[:, T // 2: T // 2 + 3] = -100
    first = 2 * torch.arange(rows)[:, None] + 1
    doc_ids = torch.where(torch.arange(T) < T // 2, first, first + 1)
    pos = torch.cat([torch.arange(T // 2), torch.arange(T - T // 2)]).expand(rows, T).contiguous()
    out = {"input_ids": ids, "labels": labels, "doc_ids": doc_ids, "position_ids": pos,
           "group_docs": torch.stack([first[:, 0], first[:, 0] + 1], 1)}   # (chosen, rejected) = a row's two documents
    return {**{k: v.to(device) for k, v in out.items()}, "packed": True}


def step_grads(model, loss_fn, b, device):
    model.zero_grad(set_to_none=True)
    with torch.autocast(device.type, dtype=torch.bfloat16):
        loss = loss_fn(model, b)[0]
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}


def check_same_step(device, arch):
    fp32 = lora_model(arch).to(device)
    half = copy.deepcopy(fp32)
    _frozen_gemm_weights_in_compute_dtype(half, Runtime(CUDA, torch.bfloat16))
    dpo = PreferenceLoss(beta=0.1, nll_weight=0.5, kind="dpo")
    for loss_fn, b in ((causal_lm_loss, batch(device)), (dpo, batch(device, seed=2))):
        loss32, g32 = step_grads(fp32, loss_fn, b, device)
        loss16, g16 = step_grads(half, loss_fn, b, device)
        assert torch.isfinite(loss32) and loss32.item() != 0
        torch.testing.assert_close(loss16, loss32, atol=0, rtol=0)
        assert g16.keys() == g32.keys() and g32
        for n in g32:
            torch.testing.assert_close(g16[n], g32[n], atol=0, rtol=0, msg=n)


@pytest.mark.parametrize("arch", list(LAYOUT_PROJECTIONS))
def test_the_step_equals_fp32_frozen_weights_under_cpu_autocast(arch):
    with kernels.using("reference", "sdpa"):
        check_same_step(torch.device("cpu"), arch)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("attention", ["sdpa", "flex"])
@pytest.mark.parametrize("arch", ["qwen3", "glm4"])
def test_the_step_equals_fp32_frozen_weights_on_the_gpu(arch, attention):
    with kernels.using("auto", attention):
        check_same_step(CUDA, arch)
