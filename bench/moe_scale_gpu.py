"""LoRA SFT on real GLM mixture-of-experts shapes on one GPU, built at random init with the routed experts made
directly in 4 bits (no checkpoint, nothing downloaded; the full-precision expert stack never exists on the GPU).

Shapes (config.json values of the released models; no MTP layer):
  glm45_air    GLM-4.5-Air (106B): Glm4MoeForCausalLM, hidden 4096, 46 layers (the first dense, intermediate 10944),
               96 heads × 128 (8 kv heads), partial rotary 0.5, attention bias, 128 routed experts top-8
               (moe_intermediate 1408), one shared expert, vocab 151552
  glm47_flash  GLM-4.7-Flash (30B-A3B): Glm4MoeLiteForCausalLM, hidden 2048, 47 layers (the first dense, intermediate
               10240), 20 heads of latent attention (q_lora_rank 768, kv_lora_rank 512, qk 192 + 64, v 256),
               64 routed experts top-4 (moe_intermediate 1536), one shared expert, vocab 154880
Experts `nf4` (lora.quantization nf4: every routed expert and every LoRA-wrapped linear in 4 bits) or `bf16` (the
frozen GEMM weights in bf16, the adapter stage's policy on CUDA). Embeddings, norms and the adapter fp32, lm_head bf16.
LoRA r/α on `--targets` (default all-linear: attention, dense and shared MLPs, every routed expert), fused AdamW,
activation checkpointing, bf16 autocast, packed rows of `--seq-len` tokens. Timing: bench.workloads.WARMUP_RULE, then
p20/p50/p80 step times, real tokens/s, peak memory; beside it engine/memory.py's estimate for the same run.
transformers + PEFT + bitsandbytes QLoRA on these shapes: bitsandbytes quantises nn.Linear layers only, and
transformers 5 holds routed experts as 3-D parameters, so its experts stay bf16 (`hf_qlora_bf16_experts_gib`).

    python -m bench.moe_scale_gpu --shape glm45_air --experts nf4 [--r 8] [--steps 6] [--smoke]
"""
from __future__ import annotations

import json
import time

import torch
import torch.nn as nn

from bench.common import write_result
from bench.workloads import WARMUP_RULE, RandomSFT, free, guarded, parser, scaled_lengths, timed_steps, train_step
from glm_lora.configs.schema import LoRAConfig, TrainConfig
from glm_lora.data.packing import PackedBatches
from glm_lora.data.sampler import EpochSampler
from glm_lora.engine.memory import GiB, lora_memory
from glm_lora.engine.optim import build_optimizer
from glm_lora.kernels import ops as kernels
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.model.heads import causal_lm_loss
from glm_lora.model.lora import cast_frozen_gemm_weights
from glm_lora.model.model import Experts, Router, shapes_only
from glm_lora.model.quant import NF4Params

SHAPES = {
    "glm45_air": dict(arch="glm4_moe", vocab_size=151552, hidden_size=4096, num_layers=46, intermediate_size=10944,
                      num_heads=96, num_kv_heads=8, head_dim=128, partial_rotary_factor=0.5, attention_bias=True,
                      n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, n_shared_experts=1,
                      first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.0),
    "glm47_flash": dict(arch="glm4_moe_lite", vocab_size=154880, hidden_size=2048, num_layers=47,
                        intermediate_size=10240, num_heads=20, num_kv_heads=20, q_lora_rank=768, kv_lora_rank=512,
                        qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, head_dim=64,
                        n_routed_experts=64, num_experts_per_tok=4, moe_intermediate_size=1536, n_shared_experts=1,
                        first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=1.8),
    "smoke": dict(arch="glm4_moe", vocab_size=1000, hidden_size=64, num_layers=2, intermediate_size=128, num_heads=2,
                  num_kv_heads=1, head_dim=32, partial_rotary_factor=0.5, attention_bias=True, n_routed_experts=8,
                  num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1, first_k_dense_replace=1,
                  n_group=1, topk_group=1, routed_scaling_factor=1.0),
}
STD = 0.02


def _random_experts(shape: torch.Size, device, dtype) -> torch.Tensor:
    return torch.randn(shape, device=device, dtype=torch.float32).mul_(STD).to(dtype)


def build(cfg: DecoderConfig, device: torch.device, experts: str, dtype: torch.dtype) -> Decoder:
    """The decoder on `device` at random init, each routed-experts stack made expert by expert (nf4) or whole, the
    frozen GEMM weights in `dtype`; every other weight materialised from the meta device as the decoder initialises it."""
    with shapes_only():
        model = Decoder(cfg)
    for m in model.modules():
        if type(m) is Experts:
            for name in ("gate_up_proj", "down_proj"):
                E, *shape = getattr(m, name).shape
                delattr(m, name)
                if experts == "nf4":
                    w = NF4Params.stacked((_random_experts(shape, device, dtype) for _ in range(E)), E)
                else:
                    w = nn.Parameter(_random_experts((E, *shape), device, dtype), requires_grad=False)
                setattr(m, name, w)
    for module_name, m in model.named_modules():
        if type(m) is Experts or isinstance(m, NF4Params):
            continue
        for name, p in list(m._parameters.items()):
            if p is None or not p.is_meta:
                continue
            linear = isinstance(m, (nn.Linear, nn.Embedding, Router)) and name == "weight"
            t = (torch.randn(p.shape, device=device).mul_(STD) if linear
                 else torch.ones(p.shape, device=device) if name == "weight" else torch.zeros(p.shape, device=device))
            # linear weights straight to bf16 (the frozen GEMM dtype): an fp32 copy of them all would not fit
            m._parameters[name] = nn.Parameter(t.to(dtype) if isinstance(m, nn.Linear) else t)
        for name, b in list(m._buffers.items()):
            if b is not None and b.is_meta:
                m._buffers[name] = torch.zeros(b.shape, device=device, dtype=b.dtype)
    return model.train()


def run(cfg: DecoderConfig, lora: LoRAConfig, tc: TrainConfig, batches: list[dict], device, args) -> dict:
    """The figures, or where memory ran out (phase, what was allocated then and at most before)."""
    phase = {"now": "build"}
    try:
        return _run(cfg, lora, tc, batches, device, args, phase)
    except torch.OutOfMemoryError as e:
        return {"error": f"OutOfMemoryError in {phase['now']}: {str(e).splitlines()[0][:240]}",
                "allocated_gib_at_error": torch.cuda.memory_allocated() / GiB,
                "peak_mem_gb": torch.cuda.max_memory_allocated() / 1e9}


def _run(cfg, lora, tc, batches, device, args, phase: dict) -> dict:
    t0 = time.perf_counter()
    cuda = device.type == "cuda"
    model = build(cfg, device, args.experts, torch.bfloat16 if cuda else torch.float32)
    phase["now"] = "inject_lora"
    inject_lora(model, lora)
    for p in model.parameters():                # the adapter in fp32, as the stage makes it over an fp32 base
        if p.requires_grad:
            p.data = p.data.float()
    if cuda:
        cast_frozen_gemm_weights(model, torch.bfloat16)
    model.gradient_checkpointing = True
    built_s = time.perf_counter() - t0
    torch.cuda.synchronize() if device.type == "cuda" else None
    weights_gib = torch.cuda.memory_allocated() / GiB if device.type == "cuda" else 0.0
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = build_optimizer(model, 2e-4, 0.0, fused=device.type == "cuda")
    step = train_step(lambda b: causal_lm_loss(model, b)[0], opt, device)
    phase["now"] = f"training steps (weights and adapter {weights_gib:.1f} GiB)"
    with kernels.using("auto", "flex" if device.type == "cuda" else "sdpa"):
        res = timed_steps(step, batches, device, args.steps, max_warmup=args.max_warmup, max_measure_s=120)
    return {**res, "build_s": built_s, "weights_and_adapter_gib": weights_gib, "trainable_params": trainable}


def hf_qlora_bf16_experts_gib(cfg: DecoderConfig) -> float:
    """What transformers + bitsandbytes leaves in bf16 on these shapes: the routed experts' 3-D parameters."""
    return (cfg.num_layers - cfg.first_k_dense_replace) * cfg.n_routed_experts * 3 * cfg.hidden_size * cfg.moe_intermediate_size * 2 / GiB


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", default="glm45_air", choices=[s for s in SHAPES if s != "smoke"])
    ap.add_argument("--experts", default="nf4", choices=["nf4", "bf16"])
    ap.add_argument("--r", type=int, default=8)
    ap.add_argument("--targets", default="all-linear", help="comma-separated target_modules, or all-linear")
    ap.add_argument("--seq-len", type=int, default=4096)
    ap.add_argument("--max-warmup", type=int, default=3)
    args = ap.parse_args()
    smoke = args.smoke
    if smoke:
        args.steps, args.max_warmup, args.seq_len = 2, 2, 128
    device = torch.device("cpu" if smoke else "cuda")
    shape = "smoke" if smoke else args.shape
    cfg = DecoderConfig(max_seq_len=args.seq_len, rms_norm_eps=1e-5, **SHAPES[shape])
    targets = args.targets if args.targets == "all-linear" else args.targets.split(",")
    lora = LoRAConfig(r=args.r, alpha=2 * args.r, target_modules=targets,
                      quantization="nf4" if args.experts == "nf4" else "none")
    tc = TrainConfig(batch_size=1, seq_len=args.seq_len, activation_checkpointing=True)
    src = RandomSFT(scaled_lengths(400, args.seq_len, seed=0), cfg.vocab_size)
    stream = PackedBatches(src, iter(EpochSampler(len(src), seed=0)), rows=1, seq_len=args.seq_len)
    batches = [next(stream) for _ in range(args.max_warmup + args.steps)]
    row = guarded(lambda: run(cfg, lora, tc, batches, device, args), device)     # out of memory: recorded
    estimate = lora_memory(cfg, lora, tc, cuda_half=device.type == "cuda")
    row["estimate_gib"] = {k: v / GiB for k, v in estimate.items()}
    if row.get("peak_mem_gb"):
        row["measured_vs_estimate"] = row["peak_mem_gb"] * 1e9 / estimate["total"]
    row["hf_qlora_bf16_experts_gib"] = hf_qlora_bf16_experts_gib(cfg)
    print(json.dumps({k: row[k] for k in ("real_tokens_per_s", "step_ms_p20", "step_ms_p50", "step_ms_p80",
                                          "peak_mem_gb", "weights_and_adapter_gib", "measured_vs_estimate",
                                          "build_s", "trainable_params", "hf_qlora_bf16_experts_gib", "error",
                                          "allocated_gib_at_error")
                      if k in row}))
    free(device)
    path = write_result(f"moe_scale_{shape}_{args.experts}" + ("_smoke" if smoke else ""), {
        "shape": {**SHAPES[shape], "seq_len": args.seq_len, "rows": 1}, "experts": args.experts,
        "lora": {"r": args.r, "alpha": 2 * args.r, "targets": targets, "quantization": lora.quantization},
        "warmup_rule": WARMUP_RULE, "result": row})
    print("wrote", path)


if __name__ == "__main__":
    main()
