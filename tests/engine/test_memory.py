"""engine/memory.py: the per-process memory a LoRA stage needs, from a base's layout alone (checked against
a real model's parameters), and how DDP, FSDP2, QLoRA and activation checkpointing change it; GLM-4.5 on
8 × H200 by that estimate."""
import torch

from glm_lora.configs.schema import LoRAConfig, TrainConfig
from glm_lora.engine.memory import GiB, NF4_BYTES, fits, lora_memory
from glm_lora.model import Decoder, inject_lora
from glm_lora.model.hf import decoder_config_from_hf
from glm_lora.model.lora import cast_frozen_gemm_weights
from glm_lora.model.model import shapes_only
from tests.model.test_moe_lora import moe_model


def frozen_bytes(m) -> int:
    return sum(p.numel() * p.element_size() for p in m.parameters() if not p.requires_grad)


def test_counts_match_a_built_model_and_fsdp2_shards_them():
    m = moe_model()
    lora = LoRAConfig(target_modules="all-linear", r=4, alpha=8)
    tc = TrainConfig(batch_size=2, seq_len=16)
    need = lora_memory(m.config, lora, tc)
    inject_lora(m, lora)
    fp32 = frozen_bytes(m)
    trainable = sum(p.numel() for p in m.parameters() if p.requires_grad)
    cast_frozen_gemm_weights(m, torch.bfloat16)                      # what the stage does on CUDA under bf16
    assert need["frozen_weights"] == frozen_bytes(m) < fp32 * 0.6      # GEMM weights bf16; norms, embeddings fp32
    assert need["adapter_and_optimizer"] == trainable * 16
    experts = sum(p.numel() for layer in m.model.layers[1:] for p in layer.mlp.experts.base_layer.parameters())
    assert need["routed_experts_of_those"] == experts * 2
    fsdp = lora_memory(m.config, lora, tc, world_size=4, strategy="fsdp2")
    assert fsdp["frozen_weights"] == frozen_bytes(m) / 4                # FSDP2: bf16 shards, 1/N each
    assert fsdp["activations_estimate"] == need["activations_estimate"]
    block = max(sum(p.numel() for p in b.parameters()) for b in m.model.layers)
    root = sum(p.numel() for p in m.parameters()) - sum(p.numel() for b in m.model.layers for p in b.parameters())
    assert fsdp["gathered_blocks"] == (2 * block + root) * 2 and need["gathered_blocks"] == 0
    assert lora_memory(m.config, lora, tc, world_size=4, strategy="ddp")["frozen_weights"] == need["frozen_weights"]
    assert lora_memory(m.config, lora, tc, cuda_half=False)["frozen_weights"] == fp32
    assert lora_memory(m.config, lora, tc, world_size=4, strategy="fsdp2", cuda_half=False)["frozen_weights"] == fp32 / 4


def test_qlora_and_checkpointing_lower_it():
    m = moe_model()
    tc = TrainConfig(batch_size=2, seq_len=16)
    targets = ["q_proj", "o_proj"]
    plain = lora_memory(m.config, LoRAConfig(target_modules=targets), tc)
    nf4 = lora_memory(m.config, LoRAConfig(target_modules=targets, quantization="nf4"), tc)
    q = m.model.layers[0].self_attn.q_proj.weight.numel() + m.model.layers[0].self_attn.o_proj.weight.numel()
    experts = sum(p.numel() for layer in m.model.layers[1:] for p in layer.mlp.experts.parameters())
    assert nf4["routed_experts_of_those"] == experts * NF4_BYTES             # the routed experts in 4 bits too
    assert torch.isclose(torch.tensor(plain["frozen_weights"] - nf4["frozen_weights"]),
                         torch.tensor((3 * q + experts) * (2 - NF4_BYTES)), rtol=1e-6)
    sharded = lora_memory(m.config, LoRAConfig(target_modules=targets, quantization="nf4"), tc, world_size=2,
                          strategy="fsdp2")
    assert sharded["routed_experts_of_those"] == nf4["routed_experts_of_those"] / 2
    # the LoRA linears' 4-bit weights are parameters too: FSDP2 shards them as well
    assert torch.isclose(torch.tensor(sharded["frozen_weights"]), torch.tensor(nf4["frozen_weights"] / 2), rtol=1e-6)
    ckpt = lora_memory(m.config, LoRAConfig(target_modules=["q_proj"]), tc.model_copy(update={"activation_checkpointing": True}))
    C, layers = m.config.hidden_size, m.config.num_layers
    block = plain["activations_estimate"] / layers          # without checkpointing: every block's activations kept
    assert ckpt["activations_estimate"] == tc.batch_size * tc.seq_len * layers * C * 6 + block    # saved inputs + one
    assert nf4["activations_estimate"] > plain["activations_estimate"]      # + the dequantised gate_up stack


def glm4_moe(**hf):
    """A GLM-4.5 layout from its config.json values, read as an import reads them (model/hf.py)."""
    return decoder_config_from_hf({"model_type": "glm4_moe", "attention_bias": True, "partial_rotary_factor": 0.5,
                                   "num_attention_heads": 96, "num_key_value_heads": 8, "head_dim": 128,
                                   "vocab_size": 151552, "num_experts_per_tok": 8, "n_shared_experts": 1, **hf})


GLM45 = glm4_moe(hidden_size=5120, num_hidden_layers=92, first_k_dense_replace=3, n_routed_experts=160,
                 moe_intermediate_size=1536, intermediate_size=12288)                                 # 355B
GLM45_AIR = glm4_moe(hidden_size=4096, num_hidden_layers=46, first_k_dense_replace=1, n_routed_experts=128,
                     moe_intermediate_size=1408, intermediate_size=10944)                             # 106B
EVERY_PROJECTION = LoRAConfig(target_modules="all-linear", r=16, alpha=32)
ROW_4K = TrainConfig(batch_size=1, seq_len=4096, activation_checkpointing=True)
H200 = 140 * GiB         # an H200's "141 GB" as CUDA reports it, about


def test_glm45_lora_fits_8_h200_with_bf16_fsdp2_shards_and_with_nf4_experts():
    bf16 = lora_memory(GLM45, EVERY_PROJECTION, ROW_4K, world_size=8, strategy="fsdp2")
    with shapes_only():
        assert 350e9 < Decoder(GLM45).num_params() < 360e9                       # the layout is GLM-4.5's 355B
    assert bf16["frozen_weights"] < 83 * GiB and fits(bf16["total"], H200), bf16       # fp32 shards were 164 GiB
    nf4 = lora_memory(GLM45, EVERY_PROJECTION.model_copy(update={"quantization": "nf4"}), ROW_4K, world_size=8,
                      strategy="fsdp2")
    assert nf4["routed_experts_of_those"] < bf16["routed_experts_of_those"] / 3 and fits(nf4["total"], H200 / 2), nf4
