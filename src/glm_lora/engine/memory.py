"""What a LoRA stage needs in memory per process, known before it runs: the frozen base, the adapter with its
gradients and AdamW state, and the activations of a micro-batch — for dense and mixture-of-experts bases, one
process, DDP (a whole replica per GPU) or FSDP2 (parameters, gradients and optimizer state 1/N per GPU).

Counted (a model of the base's layout on the meta device, so every parameter is counted exactly):
  frozen weights  in the dtype the stage holds them in: on CUDA under bf16/fp16 (`cuda_half`), the GEMM weights
                  (linear layers, routed experts: model/lora.py `frozen_gemm_weights`, what engine/adapter_stage.py
                  casts) 2 bytes each, norms and embeddings 4; else 4 (fp32 master weights, cast per matmul by
                  autocast).
                  FSDP2 holds 1/N of them per GPU (bf16 shards on CUDA) plus the all-gathered blocks in the compute
                  dtype: the largest block twice (it and the prefetched next) and the root (embeddings, final norm,
                  lm_head), which FSDP2 keeps gathered from forward to backward.
                  nf4 (QLoRA): the LoRA linears' weights and the routed experts (`Experts`) at 0.5 byte + their
                  scales (~1/64 × 4 bytes, double-quantised: ~0.52), sharded and gathered under FSDP2 like the rest
                  (model/quant.py NF4Params: frozen integer parameters).
  adapter         4 (fp32 weight) + 4 (gradient) + 8 (AdamW's two moments) = 16 bytes per trainable parameter
  activations     an estimate, not a count: tokens × layers × (34·C + 5·k·I_moe) × 2 bytes without activation
                  checkpointing (Korthikanti et al. 2022's 34·s·b·h per layer for attention + MLP, plus the
                  routed experts' k gate/up/down rows); with it, each block's saved inputs — the fp32 residual
                  stream and the bf16 branch output, tokens × layers × C × 6 — plus one block's full activations
                  (recomputed in the backward); nf4 routed experts add one projection's dequantised stack
                  (2 bytes × E × 2I × C: kernels/triton_grouped_mm.py NF4_EXPERTS "stack");
                  latent attention (GLM-4.7-Flash, GLM-5) adds each head's expanded keys and values and their
                  gradients, 3·H·(qk_head_dim + v_head_dim) per token and layer; DSA's sparse path keeps each full
                  indexer layer's chosen key positions for the backward (index_topk × 8 bytes per token)
Routed experts are never split between GPUs by DDP; FSDP2 shards each block's stacked expert weights on the
expert dim (every rank holds E/N experts between all-gathers: tests/engine/test_dist.py).
"""
from __future__ import annotations

from glm_lora.configs.schema import LoRAConfig, TrainConfig
from glm_lora.model.lora import LoRALinear, frozen_gemm_weights, inject_lora
from glm_lora.model.model import Decoder, DecoderConfig, Experts, shapes_only

GiB = 2**30
NF4_BYTES = 0.52        # a 4-bit weight with its share of the double-quantised block scales


def lora_memory(layout: DecoderConfig, lora: LoRAConfig, tc: TrainConfig, *, world_size: int = 1,
                strategy: str = "ddp", cuda_half: bool = True) -> dict:
    """Bytes per process, by part, for a LoRA stage on a base of `layout` (see the module docstring); `cuda_half`:
    the stage runs where `Runtime.weights_in_compute_dtype` (CUDA under bf16/fp16)."""
    with shapes_only():
        model = Decoder(layout)
        inject_lora(model, lora.model_copy(update={"quantization": "none"}))   # nf4 can't quantise meta tensors
    sharded = strategy == "fsdp2"
    shard = world_size if sharded else 1
    nf4 = lora.quantization == "nf4"
    experts = [p for m in model.modules() if isinstance(m, Experts) for p in m.parameters()]
    linears = [m.weight for m in model.modules() if isinstance(m, LoRALinear)]
    four_bit = {id(p) for p in experts + linears} if nf4 else set()
    half = {id(p) for p in frozen_gemm_weights(model)} if cuda_half else set()

    def held(params) -> float:          # per process
        return sum(p.numel() * (NF4_BYTES if id(p) in four_bit else 2 if id(p) in half else p.element_size()) / shard
                   for p in params)

    def gathered(params) -> float:      # FSDP2's all-gather: the compute dtype, or the 4-bit weights as they are
        return sum(p.numel() * (NF4_BYTES if id(p) in four_bit else 2 if cuda_half else 4) for p in params)

    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    tokens = tc.batch_size * tc.seq_len
    k, inter = layout.num_experts_per_tok, layout.moe_intermediate_size
    mla = 3 * layout.num_heads * (layout.qk_head_dim + layout.v_head_dim) if layout.layout.mla else 0
    block = (34 * layout.hidden_size + 5 * k * inter + mla) * 2                # one block's activations per token
    layers = layout.num_layers
    stored = (layers * layout.hidden_size * 6 + block) if tc.activation_checkpointing else layers * block
    gate_up = layout.n_routed_experts * 2 * layout.moe_intermediate_size * layout.hidden_size
    dequantised = 2 * gate_up if nf4 and experts else 0                       # the largest stack: gate_up's
    full_indexers = sum(t == "full" for t in layout.indexer_types) if tc.seq_len > layout.index_topk else 0
    in_blocks = {id(p) for block in model.model.layers for p in block.parameters()}
    root = [p for p in model.parameters() if id(p) not in in_blocks]
    largest_block = max(gathered(block.parameters()) for block in model.model.layers)
    out = {"frozen_weights": held(p for p in model.parameters() if not p.requires_grad),
           "routed_experts_of_those": held(experts),
           "gathered_blocks": 2 * largest_block + gathered(root) if sharded else 0,   # this block, the next, the root
           "adapter_and_optimizer": trainable * 16 / shard,
           "activations_estimate": tokens * (stored + full_indexers * layout.index_topk * 8) + dequantised}
    out["total"] = sum(v for k, v in out.items() if k != "routed_experts_of_those")
    return out


def fits(need: float, have: float) -> bool:
    """Whether `need` bytes fit a GPU of `have`: 5% is left to what the estimate does not count (the CUDA context,
    the allocator's fragmentation, kernels' workspaces)."""
    return need <= 0.95 * have


def describe(need: dict) -> str:
    return ", ".join(f"{k.replace('_', ' ')} {v / GiB:.2f} GiB" for k, v in need.items())
