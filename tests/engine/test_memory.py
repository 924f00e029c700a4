"""engine/memory.py: the per-process memory a LoRA stage needs, from a base's layout alone (checked against
a real model's parameters), and how DDP, FSDP2, QLoRA and activation checkpointing change it."""
import torch

from glm_lora.configs.schema import LoRAConfig, TrainConfig
from glm_lora.engine.memory import lora_memory
from glm_lora.model import inject_lora
from tests.model.test_moe_lora import moe_model


def test_counts_match_a_built_model_and_fsdp2_shards_them():
    m = moe_model()
    lora = LoRAConfig(target_modules="all-linear", r=4, alpha=8)
    tc = TrainConfig(batch_size=2, seq_len=16)
    need = lora_memory(m.config, lora, tc)
    inject_lora(m, lora)
    frozen = sum(p.numel() for p in m.parameters() if not p.requires_grad)
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    assert need["frozen_weights"] == frozen * 2                      # a MoE base on CUDA: bf16 frozen weights
    assert need["adapter_and_optimizer"] == trainable * 16
    experts = sum(p.numel() for layer in m.model.layers[1:] for p in layer.mlp.experts.base_layer.parameters())
    assert need["routed_experts_of_those"] == experts * 2
    fsdp = lora_memory(m.config, lora, tc, world_size=4, strategy="fsdp2")
    assert fsdp["frozen_weights"] == frozen * 4 / 4                   # FSDP2: fp32 shards, 1/N each
    assert fsdp["activations_estimate"] == need["activations_estimate"]
    block = max(sum(p.numel() for p in b.parameters() if not p.requires_grad) for b in m.model.layers)
    assert fsdp["gathered_blocks"] >= 2 * block * 2 and need["gathered_blocks"] == 0
    assert lora_memory(m.config, lora, tc, world_size=4, strategy="ddp")["frozen_weights"] == need["frozen_weights"]
    assert lora_memory(m.config, lora, tc, cuda_half=False)["frozen_weights"] == frozen * 4


def test_qlora_and_checkpointing_lower_it():
    m = moe_model()
    tc = TrainConfig(batch_size=2, seq_len=16)
    plain = lora_memory(m.config, LoRAConfig(target_modules=["q_proj", "o_proj"]), tc)
    nf4 = lora_memory(m.config, LoRAConfig(target_modules=["q_proj", "o_proj"], quantization="nf4"), tc)
    q = m.model.layers[0].self_attn.q_proj.weight.numel() + m.model.layers[0].self_attn.o_proj.weight.numel()
    assert torch.isclose(torch.tensor(plain["frozen_weights"] - nf4["frozen_weights"]),
                         torch.tensor(3 * q * (2 - 0.52)), rtol=1e-6)
    ckpt = lora_memory(m.config, LoRAConfig(target_modules=["q_proj"]), tc.model_copy(update={"activation_checkpointing": True}))
    assert ckpt["activations_estimate"] < plain["activations_estimate"] / 10
