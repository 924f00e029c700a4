"""LoRA SFT step on a GLM-4.5-style mixture of experts: ours vs transformers + PEFT, one process, same packed rows.

Shape (`--shape air8`, stated in every result): Glm4MoeForCausalLM, hidden 2048, 16 heads × 128 (4 kv heads),
8 layers (the first dense, intermediate 5632), 64 routed experts top-8 (moe_intermediate 1408, GLM-4.5-Air's),
one shared expert, n_group 1, vocab 32000, random init; rows 8 × 2048 packed (several documents a row).
LoRA r16 α32 on the same projections both sides: attention q/k/v/o, the dense MLP, the shared expert and every
routed expert's gate/up/down (PEFT: target_modules for attention, target_parameters for the MLPs — what
transformers 5 + PEFT 0.21 need to reach 3D expert weights, with gate/up as one rank-2r pair: the same update).

Providers:
  ours          our Decoder (kernels "auto": the grouped expert GEMM, fused LoRA, FlexAttention block mask), frozen
                GEMM weights bf16 (engine/adapter_stage.py's policy for MoE bases), adapter fp32, bf16 autocast
  ours_loop     the same with the experts' GEMMs as the per-expert loop (kernels.reference.grouped_mm)
  ours_nf4      ours with lora.quantization nf4: every routed expert and LoRA-wrapped linear held in 4 bits (QLoRA),
                the experts dequantised tile by tile inside the grouped GEMM
  hf_peft       Glm4MoeForCausalLM in bf16 with experts_implementation "grouped_mm" (torch._grouped_mm) and
                flex_attention, PEFT LoRA (adapter fp32, PEFT's default autocast_adapter_dtype), the packed rows
                padding-free (position_ids; transformers finds the documents), bf16 autocast
  hf_peft_eager the same with transformers' default experts loop ("eager")
Liger has no Glm4Moe patches (liger-kernel 0.8.5): none applied. Fused AdamW lr 2e-4 everywhere.
Timing: bench.workloads.WARMUP_RULE, then p20/p50/p80 step times, real tokens/s, peak memory.

    python -m bench.moe_gpu [--steps 8] [--providers ours,hf_peft] [--profile-dir DIR] [--smoke]
"""
from __future__ import annotations

import json
from pathlib import Path
import torch

from glm_lora.kernels import ops as kernels
from bench.common import write_result
from bench.workloads import (WARMUP_RULE, RandomSFT, free, guarded, parser, ratios, scaled_lengths, timed_steps,
                             train_step)
from glm_lora.configs.schema import LoRAConfig
from glm_lora.data.packing import PackedBatches
from glm_lora.data.sampler import EpochSampler
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.optim import build_optimizer
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.model.lora import cast_frozen_gemm_weights

SHAPES = {
    "air8": dict(hidden_size=2048, num_heads=16, num_kv_heads=4, head_dim=128, num_layers=8, intermediate_size=5632,
                 n_routed_experts=64, num_experts_per_tok=8, moe_intermediate_size=1408, n_shared_experts=1,
                 first_k_dense_replace=1, n_group=1, topk_group=1, routed_scaling_factor=2.5),
    "smoke": dict(hidden_size=64, num_heads=2, num_kv_heads=1, head_dim=32, num_layers=2, intermediate_size=96,
                  n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32, n_shared_experts=1,
                  first_k_dense_replace=1, n_group=2, topk_group=1, routed_scaling_factor=2.5),
}
R, ALPHA = 16, 32
PROVIDERS = ("ours", "ours_loop", "ours_nf4", "hf_peft", "hf_peft_eager")


def our_config(shape: str, vocab: int, seq_len: int) -> DecoderConfig:
    return DecoderConfig(vocab_size=vocab, max_seq_len=seq_len, arch="glm4_moe", attention_bias=True, qk_norm=True,
                         rms_norm_eps=1e-5, **SHAPES[shape])


def hf_config(cfg: DecoderConfig, experts_impl: str, attn: str):
    from transformers import Glm4MoeConfig
    c = Glm4MoeConfig(vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
                      num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
                      num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim,
                      max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps,
                      n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
                      moe_intermediate_size=cfg.moe_intermediate_size, n_shared_experts=cfg.n_shared_experts,
                      first_k_dense_replace=cfg.first_k_dense_replace, n_group=cfg.n_group, topk_group=cfg.topk_group,
                      routed_scaling_factor=cfg.routed_scaling_factor, use_qk_norm=True, attention_bias=True,
                      partial_rotary_factor=0.5, num_nextn_predict_layers=0, tie_word_embeddings=False,
                      use_cache=False)
    c._attn_implementation = attn
    c._experts_implementation = experts_impl
    return c


def ours(cfg: DecoderConfig, device, loop: bool, nf4: bool = False):
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(cfg).train()
    inject_lora(model, LoRAConfig(r=R, alpha=ALPHA, target_modules="all-linear", quantization="nf4" if nf4 else "none"))
    if device.type == "cuda":
        cast_frozen_gemm_weights(model, torch.bfloat16)
    backend = "reference" if loop else "auto"

    def loss(b):
        return causal_lm_loss(model, b)[0]
    return model, loss, backend


def hf_peft(cfg: DecoderConfig, device, experts_impl: str):
    from peft import LoraConfig, get_peft_model
    from transformers import Glm4MoeForCausalLM
    torch.manual_seed(0)
    attn = "flex_attention" if device.type == "cuda" else "sdpa"
    with torch.device(device):
        base = Glm4MoeForCausalLM(hf_config(cfg, experts_impl, attn)).to(torch.bfloat16 if device.type == "cuda"
                                                                          else torch.float32).train()
    base.config._experts_implementation = experts_impl       # read at each forward (transformers.integrations.moe)
    lora = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM",
                      target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                      target_parameters=["gate_proj.weight", "up_proj.weight", "down_proj.weight",
                                         "mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                      rank_pattern={r".*\.gate_up_proj": 2 * R}, alpha_pattern={r".*\.gate_up_proj": 2 * ALPHA})
    model = get_peft_model(base, lora)

    def loss(b):
        return model(input_ids=b["input_ids"], position_ids=b["position_ids"], labels=b["labels"],
                     use_cache=False).loss
    return model, loss, None


def run(name: str, cfg: DecoderConfig, batches: list[dict], args, device) -> dict:
    if name.startswith("ours"):
        model, loss, backend = ours(cfg, device, loop=name == "ours_loop", nf4=name == "ours_nf4")
    else:
        model, loss, backend = hf_peft(cfg, device, "eager" if name == "hf_peft_eager" else "grouped_mm")
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = build_optimizer(model, 2e-4, 0.0, fused=device.type == "cuda")
    step = train_step(loss, opt, device)
    with kernels.using(backend or "auto", "flex" if device.type == "cuda" else "sdpa"):
        res = timed_steps(step, batches, device, args.steps, max_warmup=args.max_warmup,
                          max_measure_s=args.max_measure_s)
        if args.profile_dir and name in ("ours", "hf_peft"):
            from bench.peer_gpu import profile
            res["profile"] = profile(step, batches[:3], device, Path(args.profile_dir) / f"profile_moe_{name}.txt")
    impl = getattr(getattr(model, "config", None), "_experts_implementation", None)
    return {**res, "trainable_params": trainable, **({"experts_implementation": impl} if impl else {})}


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", default="air8", choices=[s for s in SHAPES if s != "smoke"])
    ap.add_argument("--max-warmup", type=int, default=6)
    ap.add_argument("--max-measure-s", type=float, default=60.0)
    ap.add_argument("--profile-dir", default=None, help="torch.profiler over 3 more steps of ours and hf_peft, here")
    args = ap.parse_args()
    smoke = args.smoke
    if smoke:
        args.steps, args.max_warmup = 2, 2
    device = torch.device("cpu" if smoke else "cuda")
    shape, vocab, seq_len = ("smoke", 1000, 256) if smoke else (args.shape, 32000, 2048)
    cfg = our_config(shape, vocab, seq_len)
    src = RandomSFT(scaled_lengths(4000 if not smoke else 200, seq_len, seed=0), vocab)
    stream = PackedBatches(src, iter(EpochSampler(len(src), seed=0)), rows=8, seq_len=seq_len)
    batches = [next(stream) for _ in range(args.max_warmup + args.steps)]
    wanted = [p for p in args.providers.split(",") if p] or list(PROVIDERS)
    rows = {}
    for name in wanted:             # each provider's figures as soon as it ends (a time limit keeps what finished)
        rows[name] = guarded(lambda: run(name, cfg, batches, args, device), device)
        print("done", name, json.dumps({k: v for k, v in rows[name].items() if k != "profile"}), flush=True)
    ratios(rows, "hf_peft")
    for name, r in rows.items():
        print(name, json.dumps({k: r[k] for k in ("real_tokens_per_s", "step_ms_p20", "step_ms_p50", "step_ms_p80",
                                                   "peak_mem_gb", "tokens_per_s_vs_hf_peft", "peak_mem_vs_hf_peft",
                                                   "error") if k in r}))
    free(device)
    path = write_result("moe_lora_sft" + ("_smoke" if smoke else ""), {
        "shape": {**SHAPES[shape], "vocab": vocab, "rows": 8, "seq_len": seq_len}, "lora": {"r": R, "alpha": ALPHA},
        "warmup_rule": WARMUP_RULE, "providers": rows})
    print("wrote", path)


if __name__ == "__main__":
    main()
