"""Our LoRA adapter → PEFT format, for every supported layout: transformers + peft reproduce our adapted
model's logits; fused layouts (GLM's gate_up_proj) also get the split form vLLM loads."""
import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from glm_lora.configs.schema import LoRAConfig
from glm_lora.model.adapters import ADAPTER_CONFIG, ADAPTER_WEIGHTS, apply_adapter, load_policy, save_adapter
from glm_lora.export.hf_peft import VLLM_SPLIT_ARCHS, write_peft_adapter
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.model.hf import HF_ARCHITECTURES, load_native, save_hf, save_native
from glm_lora.model.lora import lora_modules, saved_modules
from glm_lora.model.adapters import served_form

torch.set_num_threads(1)   # tiny shapes: extra threads only add contention on a shared CPU

VOCAB = 173
PROJECTIONS = {"llama": ["down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj"],
               "glm": ["down_proj", "gate_up_proj", "k_proj", "o_proj", "q_proj", "v_proj"]}
PROJECTIONS |= {"qwen2": PROJECTIONS["llama"], "qwen3": PROJECTIONS["llama"], "glm4": PROJECTIONS["glm"]}


def tiny(tie=False, arch="llama") -> Decoder:
    torch.manual_seed(0)
    model = Decoder(DecoderConfig(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_heads=2, num_kv_heads=1,
                                  intermediate_size=48, max_seq_len=32, tie_embeddings=tie, arch=arch))
    with torch.no_grad():     # norms start at 1 and biases at 0: randomise so a wrong mapping would show
        for n, p in model.named_parameters():
            if "norm" in n:
                p.add_(0.3 * torch.randn_like(p))
            elif n.endswith(".bias"):
                p.normal_(std=0.3)
    return model.eval()


def trained_adapter(model: Decoder, lora: LoRAConfig, seed=1) -> Decoder:
    inject_lora(model, lora)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():    # stand-in for training: B non-zero, A perturbed, saved modules changed
        for m in lora_modules(model).values():
            m.lora_B.weight.copy_(torch.randn(m.lora_B.weight.shape, generator=g) * 0.3)
            m.lora_A.weight.add_(torch.randn(m.lora_A.weight.shape, generator=g) * 0.1)
        for m in saved_modules(model, lora.modules_to_save).values():
            m.weight.add_(torch.randn(m.weight.shape, generator=g) * 0.05)
    return model.eval()


def ids():
    return torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(7))


def targets(arch: str, lora: LoRAConfig) -> list[str]:
    return PROJECTIONS[arch] if lora.target_modules == "all-linear" else sorted(lora.target_modules)


@pytest.fixture(params=[
    ("llama", LoRAConfig(r=4, alpha=12.0, target_modules=["v_proj", "q_proj", "down_proj"]), False),
    ("llama", LoRAConfig(r=2, alpha=2.0), True),      # all-linear, tied embeddings
    ("qwen2", LoRAConfig(r=4, alpha=8.0), False),
    ("qwen3", LoRAConfig(r=4, alpha=8.0), True),
    ("glm", LoRAConfig(r=4, alpha=8.0, modules_to_save=["embed_tokens", "lm_head"]), False),
    ("glm4", LoRAConfig(r=4, alpha=8.0), False),
    ("glm4", LoRAConfig(r=2, alpha=6.0, target_modules=["gate_up_proj", "k_proj"]), True),
], ids=["llama-subset-scale3", "llama-all-tied", "qwen2-all", "qwen3-all-tied", "glm-all-saved", "glm4-all",
        "glm4-fused+k-tied"])
def exported(request, tmp_path):
    arch, lora, tie = request.param
    base = tiny(tie, arch)
    save_native(base, tmp_path / "base")
    hf_dir = tmp_path / "hf"
    save_hf(base, hf_dir, bos_id=None, eos_id=None, pad_id=None)
    ours = trained_adapter(load_native(tmp_path / "base").eval(), lora)
    (tmp_path / "sft").mkdir()
    save_adapter(ours, lora, tmp_path / "sft")
    split = write_peft_adapter(tmp_path / "sft", tmp_path / "peft", str(hf_dir), arch in VLLM_SPLIT_ARCHS)
    assert split is (arch == "glm4" and "gate_up_proj" in targets(arch, lora))
    return tmp_path, lora, ours


def test_peft_reproduces_our_adapted_logits(exported):
    root, lora, ours = exported
    hf = AutoModelForCausalLM.from_pretrained(root / "hf", dtype=torch.float32)
    assert type(hf).__name__ == HF_ARCHITECTURES[ours.config.arch]
    peft_model = PeftModel.from_pretrained(hf, root / "peft").eval()
    x = ids()
    with torch.no_grad():
        expected = ours(x)
        got = peft_model(input_ids=x).logits
        print(f"PEFT {ours.config.arch} {lora.target_modules}: max abs diff {(got - expected).abs().max().item():.2e}")
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
    assert cfg["target_modules"] == targets(ours.config.arch, lora)     # "all-linear" resolved to the layout's names
    assert cfg["bias"] == "none" and cfg["use_dora"] is False
    assert cfg["modules_to_save"] == (lora.modules_to_save or None)
    assert cfg["use_rslora"] is False      # scale is alpha / r, as in LoRALinear
    assert cfg["base_model_name_or_path"] == str(root / "hf")
    state = load_file(root / "peft" / "adapter_model.safetensors")
    ours_sd = load_file(root / "sft" / ADAPTER_WEIGHTS)
    assert set(state) == {f"base_model.model.{k}" for k in ours_sd}
    lora_keys = [k for k in state if ".lora_" in k]
    assert all(k.startswith("base_model.model.model.layers.") and k.endswith((".lora_A.weight", ".lora_B.weight"))
               for k in lora_keys)
    for k, v in ours_sd.items():
        torch.testing.assert_close(state[f"base_model.model.{k}"], v, atol=0, rtol=0)
    assert len(lora_keys) == 2 * 2 * len(cfg["target_modules"])   # 2 layers × (A, B) per target


def test_vllm_split_adapter(exported):
    """GLM-4-0414: adapters/<name>-vllm holds gate_up_proj's LoRA as gate_proj + up_proj (A copied, B split by
    rows at the intermediate size); everything else is the PEFT adapter unchanged. GLM (vLLM's Transformers
    backend takes the fused form) and unfused layouts get none."""
    root, lora, ours = exported
    split_dir = root / "peft-vllm"
    fused = ours.config.arch == "glm4" and "gate_up_proj" in targets(ours.config.arch, lora)
    assert split_dir.is_dir() is fused
    if not fused:
        assert served_form(root, "peft")["vllm_dir"] == "peft"
        return
    peft_cfg = json.loads((root / "peft" / "adapter_config.json").read_text())
    cfg = json.loads((split_dir / "adapter_config.json").read_text())
    assert cfg["target_modules"] == sorted(set(peft_cfg["target_modules"]) - {"gate_up_proj"} | {"gate_proj", "up_proj"})
    assert {k: v for k, v in cfg.items() if k != "target_modules"} == {k: v for k, v in peft_cfg.items()
                                                                      if k != "target_modules"}
    fused_sd = load_file(root / "peft" / "adapter_model.safetensors")
    split_sd = load_file(split_dir / "adapter_model.safetensors")
    assert not any("gate_up_proj" in k for k in split_sd)
    I = ours.config.intermediate_size
    for i in range(ours.config.num_layers):
        p = f"base_model.model.model.layers.{i}.mlp."
        a, b = fused_sd[p + "gate_up_proj.lora_A.weight"], fused_sd[p + "gate_up_proj.lora_B.weight"]
        assert b.shape == (2 * I, lora.r)
        for half, rows in (("gate_proj", slice(0, I)), ("up_proj", slice(I, 2 * I))):
            torch.testing.assert_close(split_sd[p + f"{half}.lora_A.weight"], a, atol=0, rtol=0)
            torch.testing.assert_close(split_sd[p + f"{half}.lora_B.weight"], b[rows], atol=0, rtol=0)
        # the same update: [B_gate A; B_up A] == B A
        delta = torch.cat([split_sd[p + f"{h}.lora_B.weight"] @ split_sd[p + f"{h}.lora_A.weight"]
                           for h in ("gate_proj", "up_proj")])
        torch.testing.assert_close(delta, b @ a, atol=0, rtol=0)
    others = {k for k in fused_sd if "gate_up_proj" not in k}
    assert others == {k for k in split_sd if ".gate_proj." not in k and ".up_proj." not in k}
    for k in others:
        torch.testing.assert_close(split_sd[k], fused_sd[k], atol=0, rtol=0)
    # what export records for the server (its manifest's `adapters`): the split form where it wrote one
    assert served_form(root, "peft") == {"dir": "peft", "vllm_dir": "peft-vllm", "r": lora.r, "unservable": None,
                                        "moe": False}
    shutil.rmtree(split_dir)
    assert served_form(root, "peft")["vllm_dir"] == "peft"


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
    second_lora = LoRAConfig(r=3, alpha=3.0, target_modules=["o_proj", "down_proj"])   # in every layout
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
