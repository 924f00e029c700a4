"""Our LoRA adapter → PEFT format: transformers + peft reproduce our adapted model's logits."""
import json

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import LlamaForCausalLM

from configs.schema import LoRAConfig
from engine.stages import ADAPTER_CONFIG, ADAPTER_WEIGHTS, apply_adapter, load_policy, save_adapter
from export import write_peft_adapter
from model import Decoder, DecoderConfig, inject_lora
from model.hf import load_native, save_hf, save_native
from model.lora import lora_modules

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

VOCAB = 173


def tiny(tie=False) -> Decoder:
    torch.manual_seed(0)
    return Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                 intermediate_size=48, max_seq_len=32, tie_embeddings=tie)).eval()


def trained_adapter(model: Decoder, lora: LoRAConfig, seed=1) -> Decoder:
    inject_lora(model, lora.target_modules, lora.r, lora.alpha, lora.dropout)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():    # stand-in for training: B non-zero, A perturbed
        for m in lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.3)
            m.lora_A.weight.add_(torch.randn(m.lora_A.weight.shape, generator=g) * 0.1)
    return model.eval()


def ids():
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7))


@pytest.fixture(params=[
    (LoRAConfig(r=4, alpha=12.0, target_modules=["v_proj", "q_proj", "down_proj"]), False),
    (LoRAConfig(r=2, alpha=2.0), True),      # every target, tied embeddings
], ids=["subset-scale3", "all-tied"])
def exported(request, tmp_path):
    lora, tie = request.param
    base = tiny(tie)
    save_native(base, tmp_path / "base")
    hf_dir = tmp_path / "hf"
    save_hf(base, hf_dir, bos_id=None, eos_id=None, pad_id=None)
    ours = trained_adapter(load_native(tmp_path / "base").eval(), lora)
    (tmp_path / "sft").mkdir()
    save_adapter(ours, lora, tmp_path / "sft")
    write_peft_adapter(tmp_path / "sft", tmp_path / "peft", str(hf_dir))
    return tmp_path, lora, ours


def test_peft_reproduces_our_adapted_logits(exported):
    root, lora, ours = exported
    hf = LlamaForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    peft_model = PeftModel.from_pretrained(hf, root / "peft").eval()
    x = ids()
    with torch.no_grad():
        expected = ours(x)
        got = peft_model(input_ids=x).logits
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        with peft_model.disable_adapter():   # and the adapter really matters
            assert not torch.allclose(peft_model(input_ids=x).logits, expected, atol=1e-3)
        merged = peft_model.merge_and_unload()
        torch.testing.assert_close(merged(input_ids=x).logits, expected, atol=1e-5, rtol=1e-5)


def test_adapter_config_and_keys(exported):
    root, lora, ours = exported
    cfg = json.loads((root / "peft" / "adapter_config.json").read_text())
    assert cfg["peft_type"] == "LORA" and cfg["task_type"] == "CAUSAL_LM"
    assert cfg["r"] == lora.r and cfg["lora_alpha"] == lora.alpha
    assert cfg["target_modules"] == sorted(lora.target_modules)
    assert cfg["bias"] == "none" and cfg["modules_to_save"] is None and cfg["use_dora"] is False
    assert cfg["use_rslora"] is False      # scale is alpha / r, as in LoRALinear
    assert cfg["base_model_name_or_path"] == str(root / "hf")
    state = load_file(root / "peft" / "adapter_model.safetensors")
    ours_sd = load_file(root / "sft" / ADAPTER_WEIGHTS)
    assert set(state) == {f"base_model.model.{k}" for k in ours_sd}
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in state)
    for k, v in ours_sd.items():
        torch.testing.assert_close(state[f"base_model.model.{k}"], v, atol=0, rtol=0)
    assert len(state) == 2 * 2 * len(lora.target_modules)   # 2 layers × (A, B) per target


def test_save_adapter_writes_our_format(exported):
    root, lora, _ = exported
    assert LoRAConfig.model_validate_json((root / "sft" / ADAPTER_CONFIG).read_text()) == lora


@pytest.mark.parametrize("merge", [True, False])
def test_apply_adapter_reproduces_the_adapted_model(exported, merge):
    root, lora, ours = exported
    model = apply_adapter(load_native(root / "base"), root / "sft", merge=merge).eval()
    assert bool(lora_modules(model)) is (not merge)
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ours(x), atol=1e-5, rtol=1e-5)


def test_load_policy_merges_adapters_in_order_and_is_trainable(exported, tmp_path):
    root, lora, ours = exported
    # a second adapter (like DPO) trained on top of the SFT-merged weights
    second_lora = LoRAConfig(r=3, alpha=3.0, target_modules=["o_proj", "up_proj"])
    stacked = trained_adapter(load_policy(root / "base", root / "sft").eval(), second_lora, seed=5)
    (tmp_path / "dpo").mkdir()
    save_adapter(stacked, second_lora, tmp_path / "dpo")
    policy = load_policy(root / "base", root / "sft", tmp_path / "dpo").eval()
    assert not lora_modules(policy)
    assert all(p.requires_grad for p in policy.parameters())
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(policy(x), stacked(x), atol=1e-5, rtol=1e-5)
        assert not torch.allclose(policy(x), ours(x), atol=1e-3)


def test_apply_adapter_rejects_a_mismatched_adapter(exported):
    root, lora, _ = exported
    cfg = lora.model_dump()
    cfg["target_modules"] = ["k_proj"]
    (root / "sft" / ADAPTER_CONFIG).write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="adapter does not match"):
        apply_adapter(load_native(root / "base"), root / "sft")
