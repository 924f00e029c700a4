"""What a LoRA stage needs in memory per process, known before it runs: the frozen base, the adapter with its
gradients and AdamW state, and the activations of a micro-batch — for dense and mixture-of-experts bases, one
process, DDP (a whole replica per GPU) or FSDP2 (parameters, gradients and optimizer state 1/N per GPU).

Counted (a model of the base's layout on the meta device, so every parameter is counted exactly):
  frozen weights  2 bytes each on CUDA under bf16/fp16 (engine/adapter_stage.py keeps the base's GEMM
                  weights in the compute dtype), else 4 (fp32 master weights, cast per matmul by autocast; FSDP2's
                  fp32 shards, plus the bf16 all-gather of the largest block twice: it and the prefetched next);
                  nf4 layers (QLoRA) 0.5 byte + their scales (~1/64 × 4 bytes, double-quantised: ~0.52)
  adapter         4 (fp32 weight) + 4 (gradient) + 8 (AdamW's two moments) = 16 bytes per trainable parameter
  activations     an estimate, not a count: tokens × layers × (34·C + 5·k·I_moe) × 2 bytes without activation
                  checkpointing (Korthikanti et al. 2022's 34·s·b·h per layer for attention + MLP, plus the
                  routed experts' k gate/up/down rows), tokens × layers × C × 2 with it (one block recomputed);
                  latent attention (GLM-4.7-Flash, GLM-5) adds each head's expanded keys and values and their
                  gradients, 3·H·(qk_head_dim + v_head_dim) per token and layer; DSA's sparse path keeps each full
                  indexer layer's chosen key positions for the backward (index_topk × 8 bytes per token)
Routed experts are never split between GPUs by DDP; FSDP2 shards each block's stacked expert weights on the
expert dim (every rank holds E/N experts between all-gathers: tests/engine/test_dist.py).
"""
from __future__ import annotations

import torch

from glm_lora.configs.schema import LoRAConfig, TrainConfig
from glm_lora.model.lora import LoRALinear, inject_lora
from glm_lora.model.model import Decoder, DecoderConfig, Experts, shapes_only

GiB = 2**30


def lora_memory(layout: DecoderConfig, lora: LoRAConfig, tc: TrainConfig, *, world_size: int = 1,
                strategy: str = "ddp", cuda_half: bool = True) -> dict:
    """Bytes per process, by part, for a LoRA stage on a base of `layout` (see the module docstring)."""
    with shapes_only():
        model = Decoder(layout)
        inject_lora(model, lora.model_copy(update={"quantization": "none"}))   # nf4 can't quantise meta tensors
    sharded = strategy == "fsdp2"
    # FSDP2 keeps fp32 shards (its mixed-precision policy casts each all-gathered block to bf16); otherwise the
    # frozen GEMM weights are bf16 on CUDA (engine/adapter_stage.py)
    frozen_bytes = 2 if (cuda_half and not sharded) else 4
    nf4 = sum(m.weight.numel() for m in model.modules() if isinstance(m, LoRALinear)) if lora.quantization == "nf4" else 0
    frozen = sum(p.numel() for p in model.parameters() if not p.requires_grad) - nf4
    experts = sum(p.numel() for m in model.modules() if isinstance(m, Experts) for p in m.parameters())
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    shard = world_size if sharded else 1
    tokens = tc.batch_size * tc.seq_len
    k, inter = layout.num_experts_per_tok, layout.moe_intermediate_size
    mla = 3 * layout.num_heads * (layout.qk_head_dim + layout.v_head_dim) if layout.layout.mla else 0
    per_token_layer = (layout.hidden_size if tc.activation_checkpointing
                       else 34 * layout.hidden_size + 5 * k * inter + mla) * 2
    full_indexers = sum(t == "full" for t in layout.indexer_types) if tc.seq_len > layout.index_topk else 0
    largest_block = max(sum(p.numel() for p in block.parameters()) for block in model.model.layers)
    out = {"frozen_weights": (frozen * frozen_bytes + nf4 * 0.52) / shard,
           "routed_experts_of_those": experts * frozen_bytes / shard,
           "gathered_blocks": 2 * largest_block * 2 if sharded else 0,     # this block + the prefetched next, bf16
           "adapter_and_optimizer": trainable * 16 / shard,
           "activations_estimate": tokens * (layout.num_layers * per_token_layer + full_indexers * layout.index_topk * 8)}
    out["total"] = sum(v for k, v in out.items() if k != "routed_experts_of_those")
    return out


def describe(need: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v / GiB:.2f} GiB" for k, v in need.items())
