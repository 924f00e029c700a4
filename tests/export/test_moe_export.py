"""A GLM-4.5 (glm4_moe) adapter exported for PEFT: one key per routed expert and the adapter_config PEFT needs
(target_parameters + the gate/up rank pattern); transformers + PEFT load it onto transformers' own
Glm4MoeForCausalLM and give our logits; merging gives the merged export's logits."""
import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from glm_lora.configs.schema import LoRAConfig
from glm_lora.export.hf_peft import write_peft_adapter
from glm_lora.model import inject_lora, merge_lora
from glm_lora.model.adapters import PEFT_CONFIG, PEFT_WEIGHTS, save_adapter, served_form
from glm_lora.model.hf import load_hf, save_hf, save_native, load_native
from glm_lora.model.lora import lora_modules
from tests.model.test_moe import hf_model, ids

torch.set_num_threads(1)


def _train_stand_in(model, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
            elif "lora_A" in n:
                p.add_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("targets, zero_filled", [
    ("all-linear", 0), (["q_proj", "shared_experts.down_proj"], 0),
    (["experts.gate_proj", "experts.up_proj", "v_proj"], 1),     # the experts' down_proj: zero factors
    (["experts.down_proj"], 2)])                                # their gate_proj and up_proj
def test_peft_loads_the_moe_adapter_with_our_logits(tmp_path, targets, zero_filled):
    hf_model("grouped").save_pretrained(tmp_path / "hf")
    ours = load_hf(tmp_path / "hf").eval()
    save_native(ours, tmp_path / "base")
    lora = LoRAConfig(r=4, alpha=8.0, target_modules=targets)
    inject_lora(ours, lora)
    _train_stand_in(ours)
    (tmp_path / "sft").mkdir()
    save_adapter(ours, lora, tmp_path / "sft")
    write_peft_adapter(tmp_path / "sft", tmp_path / "peft", str(tmp_path / "hf"), moe=True)

    keys = load_file(tmp_path / "peft" / PEFT_WEIGHTS)
    config = json.loads((tmp_path / "peft" / PEFT_CONFIG).read_text())
    routed = sorted(k for k in keys if ".mlp.experts." in k)
    if targets != ["q_proj", "shared_experts.down_proj"]:
        assert "base_model.model.model.layers.1.mlp.experts.7.up_proj.lora_B.weight" in routed
        assert keys[routed[0]].dim() == 2 and config["rank_pattern"] == {".*\\.gate_up_proj": 8}
        assert served_form(tmp_path, "peft", moe=True)["r"] == 8                 # vLLM must allow rank 2r
    else:
        assert not routed and config["target_parameters"] == ["shared_experts.down_proj.weight"]
    # every expert's LoRA is in the file; a layer's experts carry all three projections (zero where untargeted)
    own = sum(2 * (m.lora_A.weight.shape[0] if m.lora_A.weight.dim() == 3 else 1) for m in _factors(ours))
    moe_layers, experts = 2, 8
    assert len([k for k in keys if ".lora_" in k]) == own + zero_filled * moe_layers * experts * 2

    x = ids()
    with torch.no_grad():
        mine = ours(x)
        hf = AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32)
        peft = PeftModel.from_pretrained(hf, tmp_path / "peft").eval()
        diff = (peft(x).logits - mine).abs().max().item()
        assert diff <= 1e-4, diff
        base = load_native(tmp_path / "base").eval()
        assert (base(x) - mine).abs().max() > 1e-2                           # the adapter changes the model
        merge_lora(ours)
        save_hf(ours, tmp_path / "merged", bos_id=None, eos_id=None, pad_id=None)
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
        assert (merged(x).logits - mine).abs().max().item() <= 1e-4


def _factors(model):
    for m in lora_modules(model).values():
        if hasattr(m, "projections"):
            yield from (getattr(m, p) for p in m.projections())
        else:
            yield m
