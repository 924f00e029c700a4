"""LoRA SFT step on a GLM-5-style model (latent attention + DeepSeek sparse attention + experts): ours vs
transformers + PEFT on the same GlmMoeDsaForCausalLM, one process, same rows.

Shape (`--shape glm5_8l`, stated in every result): GlmMoeDsaForCausalLM, hidden 2048, 8 layers (the first dense,
intermediate 5632), 16 heads; GLM-5's latent attention with its head sizes (q_lora_rank 768 — GLM-5's 2048 scaled by
the hidden size —, kv_lora_rank 512, qk_nope 192, qk_rope 64, v 256); its indexer (32 heads × 128, index_topk
2048, every layer "full" as GLM-5.1); 64 routed experts top-8 (moe_intermediate 1024), one shared expert; vocab
32000; random init. Rows: 8 × 4096, each one document (`--docs long`: every query past 2048 picks 2048 of its keys,
the sparse path) or packed documents of the usual skewed lengths (`--docs packed`: mostly ≤ 2048, our dense path).
LoRA r16 α32 on the same projections both sides: q_a_proj, q_b_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj, the
dense MLP, the shared expert and every routed expert (PEFT: target_parameters for the MLPs, gate/up one rank-2r pair).

Providers:
  ours      our Decoder (kernels "auto": sparse attention kernel where documents pass index_topk, the grouped expert
            GEMM, fused LoRA), frozen GEMM weights bf16, adapter fp32, bf16 autocast
  ours_expanded  the same with the sparse path on each head's expanded keys and values (model.ABSORBED_SPARSE off)
  ours_kernel    the same with the sparse kernel at every length (kernels.ops.SPARSE_KERNEL_MIN_KEYS 0; "auto" takes
                 the masked-dense form below it)
  hf_peft   GlmMoeDsaForCausalLM in bf16, experts "grouped_mm", sdpa (its only attention here: the indexer's choice
            as a T × T mask), PEFT LoRA, padding-free rows (position_ids), bf16 autocast
Timing: bench.workloads.WARMUP_RULE, then p20/p50/p80 step times, real tokens/s, peak memory. `--longest` also
finds the longest single document ours trains at (one row, doubling from 8k until out of memory).

    python -m bench.dsa_gpu [--steps 6] [--providers ours,hf_peft] [--docs long|packed] [--longest] [--smoke]
"""
from __future__ import annotations

import json

import numpy as np
import torch

from bench.common import write_result
from bench.workloads import (WARMUP_RULE, RandomSFT, free, guarded, parser, ratios, scaled_lengths, timed_steps,
                             train_step)
from glm_lora.configs.schema import LoRAConfig
from glm_lora.data.packing import PackedBatches
from glm_lora.data.sampler import EpochSampler
from glm_lora.engine.optim import build_optimizer
from glm_lora.kernels import ops as kernels
from glm_lora.model import Decoder, DecoderConfig, inject_lora
from glm_lora.model import model as decoder
from glm_lora.model.heads import causal_lm_loss
from glm_lora.model.lora import cast_frozen_gemm_weights

SHAPES = {
    "glm5_8l": dict(hidden_size=2048, num_heads=16, num_layers=8, intermediate_size=5632, q_lora_rank=768,
                    kv_lora_rank=512, qk_nope_head_dim=192, qk_rope_head_dim=64, v_head_dim=256, index_topk=2048,
                    index_head_dim=128, index_n_heads=32, n_routed_experts=64, num_experts_per_tok=8,
                    moe_intermediate_size=1024, n_shared_experts=1, first_k_dense_replace=1,
                    routed_scaling_factor=2.5),
    "smoke": dict(hidden_size=64, num_heads=2, num_layers=2, intermediate_size=96, q_lora_rank=32, kv_lora_rank=32,
                  qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, index_topk=16, index_head_dim=32,
                  index_n_heads=2, n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                  n_shared_experts=1, first_k_dense_replace=1, routed_scaling_factor=2.5),
}
R, ALPHA = 16, 32
PROVIDERS = ("ours", "ours_expanded", "ours_kernel", "hf_peft")
KERNEL_FROM = kernels.SPARSE_KERNEL_MIN_KEYS
ATTENTION_TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def our_config(shape: str, vocab: int, seq_len: int) -> DecoderConfig:
    s = SHAPES[shape]
    return DecoderConfig(vocab_size=vocab, max_seq_len=seq_len, arch="glm_moe_dsa", num_kv_heads=s["num_heads"],
                         rms_norm_eps=1e-5, indexer_types=("full",) * s["num_layers"], **s)


def hf_config(cfg: DecoderConfig):
    from transformers import GlmMoeDsaConfig
    c = GlmMoeDsaConfig(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_heads,
        max_position_embeddings=cfg.max_seq_len, rms_norm_eps=cfg.rms_norm_eps, q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim, qk_rope_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim, index_topk=cfg.index_topk, index_head_dim=cfg.index_head_dim,
        index_n_heads=cfg.index_n_heads, indexer_types=list(cfg.indexer_types),
        n_routed_experts=cfg.n_routed_experts, num_experts_per_tok=cfg.num_experts_per_tok,
        moe_intermediate_size=cfg.moe_intermediate_size, n_shared_experts=cfg.n_shared_experts,
        first_k_dense_replace=cfg.first_k_dense_replace, routed_scaling_factor=cfg.routed_scaling_factor,
        tie_word_embeddings=False, use_cache=False)
    c._attn_implementation = "sdpa"
    return c


def ours(cfg: DecoderConfig, device):
    torch.manual_seed(0)
    with torch.device(device):
        model = Decoder(cfg).train()
    inject_lora(model, LoRAConfig(r=R, alpha=ALPHA, target_modules="all-linear"))
    if device.type == "cuda":
        cast_frozen_gemm_weights(model, torch.bfloat16)
    return model, lambda b: causal_lm_loss(model, b)[0]


def hf_peft(cfg: DecoderConfig, device, experts_impl: str = "grouped_mm"):
    from peft import LoraConfig, get_peft_model
    from transformers import GlmMoeDsaForCausalLM
    torch.manual_seed(0)
    with torch.device(device):
        base = GlmMoeDsaForCausalLM(hf_config(cfg)).to(torch.bfloat16 if device.type == "cuda"
                                                        else torch.float32).train()
    base.config._experts_implementation = experts_impl if device.type == "cuda" else "eager"
    lora = LoraConfig(r=R, lora_alpha=ALPHA, lora_dropout=0.0, task_type="CAUSAL_LM", target_modules=ATTENTION_TARGETS,
                      target_parameters=["gate_proj.weight", "up_proj.weight", "down_proj.weight",
                                         "mlp.experts.gate_up_proj", "mlp.experts.down_proj"],
                      rank_pattern={r".*\.gate_up_proj": 2 * R}, alpha_pattern={r".*\.gate_up_proj": 2 * ALPHA})
    model = get_peft_model(base, lora)

    def loss(b):
        return model(input_ids=b["input_ids"], position_ids=b["position_ids"], labels=b["labels"],
                     use_cache=False).loss
    return model, loss


def run(name: str, cfg: DecoderConfig, batches: list[dict], args, device) -> dict:
    model, loss = ours(cfg, device) if name.startswith("ours") else hf_peft(cfg, device)
    decoder.ABSORBED_SPARSE[device.type] = name != "ours_expanded"
    kernels.SPARSE_KERNEL_MIN_KEYS = 0 if name == "ours_kernel" else KERNEL_FROM
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = build_optimizer(model, 2e-4, 0.0, fused=device.type == "cuda")
    step = train_step(loss, opt, device)
    with kernels.using("auto", "auto" if device.type == "cuda" else "sdpa"):
        res = timed_steps(step, batches, device, args.steps, max_warmup=args.max_warmup,
                          max_measure_s=args.max_measure_s)
    paths = getattr(model, "attention_paths", None)
    return {**res, "trainable_params": trainable, **({"attention_paths": dict(paths)} if paths else {})}


def rows_of(docs: str, vocab: int, seq_len: int, n: int, rows: int = 8) -> list[dict]:
    """`long`: each row one document of seq_len tokens; `packed`: skewed lengths packed as the SFT stage packs."""
    lengths = (np.full(rows * n, seq_len) if docs == "long" else scaled_lengths(8 * rows * n, seq_len, seed=0))
    src = RandomSFT(lengths, vocab)
    stream = PackedBatches(src, iter(EpochSampler(len(src), seed=0)), rows=rows, seq_len=seq_len)
    return [next(stream) for _ in range(n)]


def longest(cfg: DecoderConfig, device, vocab: int, start: int = 8192, limit: int = 262144) -> dict:
    """The longest one-document row ours trains a step at (doubling from `start`), with its step time and memory."""
    best: dict = {}
    T = start
    while T <= limit:
        c = DecoderConfig(**{**cfg.to_dict(), "max_seq_len": T})
        batch = rows_of("long", vocab, T, 1)[0]
        batch = {k: v[:1] if torch.is_tensor(v) else v for k, v in batch.items()}
        r = guarded(lambda: run("ours", c, [batch] * 3, _Short(), device), device, oom=True)
        if "error" in r:
            best["stopped_at"] = {"tokens": T, "error": r["error"][:200]}
            break
        best = {"tokens": T, "step_ms_p50": r.get("step_ms_p50"), "peak_mem_gb": r.get("peak_mem_gb")}
        T *= 2
    return best


class _Short:
    steps, max_warmup, max_measure_s = 1, 1, 30.0


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--shape", default="glm5_8l", choices=[s for s in SHAPES if s != "smoke"])
    ap.add_argument("--docs", default="long", choices=("long", "packed"))
    ap.add_argument("--longest", action="store_true", help="also the longest one-document row ours trains at")
    ap.add_argument("--rows", type=int, default=8, help="rows a batch (8 × 4096 by default)")
    ap.add_argument("--max-warmup", type=int, default=4)
    ap.add_argument("--max-measure-s", type=float, default=60.0)
    args = ap.parse_args()
    smoke = args.smoke
    if smoke:
        args.steps, args.max_warmup = 2, 1
    device = torch.device("cpu" if smoke else "cuda")
    shape, vocab, seq_len = ("smoke", 1000, 64) if smoke else (args.shape, 32000, 4096)
    cfg = our_config(shape, vocab, seq_len)
    batches = rows_of(args.docs, vocab, seq_len, args.max_warmup + args.steps, args.rows)
    wanted = [p for p in args.providers.split(",") if p] or list(PROVIDERS)
    rows = {}
    for name in wanted:
        rows[name] = guarded(lambda: run(name, cfg, batches, args, device), device)
        print(name, json.dumps({k: v for k, v in rows[name].items() if k in ("real_tokens_per_s", "step_ms_p50",
                                                                               "peak_mem_gb", "error")}), flush=True)
    ratios(rows, "hf_peft")
    for name, r in rows.items():
        print(name, json.dumps({k: r[k] for k in ("real_tokens_per_s", "step_ms_p20", "step_ms_p50", "step_ms_p80",
                                                   "peak_mem_gb", "tokens_per_s_vs_hf_peft", "peak_mem_vs_hf_peft",
                                                   "attention_paths", "error") if k in r}))
    extra = {"longest_document": longest(cfg, device, vocab)} if args.longest and not smoke else {}
    if extra:
        print("longest", json.dumps(extra["longest_document"]))
    free(device)
    path = write_result("dsa_lora_sft" + ("_smoke" if smoke else ""), {
        "shape": {**SHAPES[shape], "vocab": vocab, "rows": args.rows, "seq_len": seq_len, "docs": args.docs},
        "lora": {"r": R, "alpha": ALPHA}, "warmup_rule": WARMUP_RULE, "providers": rows, **extra})
    print("wrote", path)


if __name__ == "__main__":
    main()
