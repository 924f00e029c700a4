"""QLoRA SFT steps (H200): our 4-bit base vs our bf16 base vs bitsandbytes + PEFT, in one process.

Same packed rows for every provider (8 × 2048, skewed lengths, answer-only labels), LoRA r64 α128 on the
7 projections in fp32, frozen weights (embeddings, norms, lm_head, base) in bf16, bf16 autocast, fused AdamW:
  ours_bf16          our Decoder, kernels/attention "auto", the base linears in bf16 (a user's LoRA)
  ours_nf4           the same with `lora.quantization: nf4` (model/quant.py, kernels/qlora.py)
  hf_bnb_liger       what a QLoRA user of the Hugging Face stack runs at speed: LlamaForCausalLM loaded by
                     from_pretrained with BitsAndBytesConfig(nf4, double quant, bf16 compute) (bnb
                     Linear4bit), Liger kernels, PEFT LoRA, the packed rows padding-free (position_ids,
                     flex_attention), as bench/anchors.py's anchor (a)
Sizes: 1b (bench.workloads.SIZES), 8b (Llama-3-8B's shape, vocab 32000) and 8b-stack (8 of its 32 layers).
--checkpointing recomputes each decoder block in backward on every side (our `activation_checkpointing`,
transformers' gradient_checkpointing_enable, non-reentrant): activations shrink and the base weights'
memory decides the peak.
Reported per provider: bench.workloads.WARMUP_RULE timing (p20/p50/p80), real tokens/s, peak memory, and the
memory the model holds before its first step (resident).

    python -m bench.qlora_gpu [--sizes 1b,8b-stack,8b] [--steps 10] [--checkpointing] [--smoke]
"""
from __future__ import annotations

import json
import tempfile
import time

import torch

from glm_lora.kernels import ops as kernels
from bench import anchors
from bench.common import write_result
from bench.peer_gpu import packed_batches
from bench.workloads import (SIZES, TARGETS, WARMUP_RULE, RandomSFT, decoder_config, free, hf_model, hf_peft,
                             our_model, parser, result_name, scaled_lengths, setup, timed_steps, train_step)
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.optim import build_optimizer
from glm_lora.model import inject_lora
from glm_lora.configs.schema import LoRAConfig

SIZES.setdefault("8b", dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336))
SIZES.setdefault("8b-stack", {**SIZES["8b"], "num_layers": 8})
PROVIDERS = ("ours_nf4", "ours_bf16", "hf_bnb_liger")
BNB = dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True)


def _fp32_adapter(model):
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def _frozen_dtype(device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32     # --smoke on the CPU: fp32, no autocast


def ours(cfg, device, quantization: str, checkpointing: bool):
    model = our_model(cfg, device, checkpointing).to(_frozen_dtype(device))
    inject_lora(model, LoRAConfig(target_modules=TARGETS, r=64, alpha=128, quantization=quantization))
    return _fp32_adapter(model)


def hf_bnb(cfg, device, cuda: bool, checkpointing: bool):
    """bnb 4-bit Llama through from_pretrained (the user's path), Liger, PEFT. Call inside anchors.liger_llama()."""
    from liger_kernel.transformers import apply_liger_kernel_to_llama
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    with tempfile.TemporaryDirectory() as tmp:
        hf_model(cfg, device, use_cache=False).to(_frozen_dtype(device)).save_pretrained(tmp)
        free(device)
        base = AutoModelForCausalLM.from_pretrained(
            tmp, quantization_config=BitsAndBytesConfig(**BNB, bnb_4bit_compute_dtype=torch.bfloat16),
            dtype=_frozen_dtype(device), attn_implementation="flex_attention" if cuda else "sdpa",
            device_map={"": device.index or 0} if cuda else None, use_cache=False)
    apply_liger_kernel_to_llama(rope=True, rms_norm=cuda, swiglu=cuda, cross_entropy=False,
                                fused_linear_cross_entropy=True, model=base)
    base.train()                    # from_pretrained gives eval mode, where checkpointing is off
    if checkpointing:
        base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return _fp32_adapter(hf_peft(cfg, device, base=base))


def run(name, size, src, args, device, vocab, seq_len) -> dict:
    cfg = decoder_config(size, vocab, seq_len)
    n = args.max_warmup + args.steps
    batches = packed_batches(src, n, seq_len)
    cuda = device.type == "cuda"
    with anchors.liger_llama(), kernels.using("auto", "auto"):
        if name == "hf_bnb_liger":
            model = hf_bnb(cfg, device, cuda, args.checkpointing)
            loss_of = anchors.liger_sft_loss(model)
        else:
            model = ours(cfg, device, "nf4" if name == "ours_nf4" else "none", args.checkpointing)
            loss_of = lambda b: causal_lm_loss(model, b)[0]     # noqa: E731
        opt = build_optimizer(model, 2e-4, 0.0, fused=cuda)
        resident = torch.cuda.memory_allocated() / 2**30 if cuda else None
        if cuda:
            torch.cuda.reset_peak_memory_stats()    # the peak of training, not of building (fp32 init)
        res = timed_steps(train_step(loss_of, opt, device), batches, device, args.steps, max_warmup=args.max_warmup)
    return {**res, "resident_gb": resident}


def main() -> None:
    ap = parser(__doc__)
    ap.set_defaults(sizes="1b,8b-stack")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--max-warmup", type=int, default=8)
    ap.add_argument("--checkpointing", action="store_true", help="activation checkpointing on every side")
    args = ap.parse_args()
    sizes, device, vocab, seq_len = setup(args)
    if args.smoke:
        args.max_warmup = 2
    src = RandomSFT(scaled_lengths(args.samples, seq_len), vocab)
    results: dict = {}
    t_start = time.perf_counter()
    for size in sizes:
        rows = results.setdefault(size, {})
        for p in PROVIDERS:
            if args.providers and p not in args.providers.split(","):
                continue
            free(device)
            t = time.perf_counter()
            try:
                rows[p] = run(p, size, src, args, device, vocab, seq_len)
            except Exception as e:          # one provider failing must not lose the others' figures
                import traceback
                traceback.print_exc()
                rows[p] = {"error": f"{type(e).__name__}: {e}"[:800]}
            free(device)
            r = rows[p]
            print(f"[{time.perf_counter() - t_start:5.0f}s] {size} {p:14s} " + (
                f"{r['real_tokens_per_s']:>9,.0f} tok/s p20/50/80 {r['step_ms_p20']:.0f}/{r['step_ms_p50']:.0f}/"
                f"{r['step_ms_p80']:.0f} ms peak {r['peak_mem_gb'] or 0:.1f} GB resident {r['resident_gb'] or 0:.2f} GB"
                f" ({time.perf_counter() - t:.0f}s)" if "error" not in r else r["error"]), flush=True)
        ok = {p: r for p, r in rows.items() if "error" not in r}
        if {"ours_nf4", "ours_bf16"} <= set(ok):
            a, b = ok["ours_nf4"], ok["ours_bf16"]
            rows["nf4_vs_bf16"] = {"speed": a["real_tokens_per_s"] / b["real_tokens_per_s"],
                                   "peak_memory": (a["peak_mem_gb"] or 0) / (b["peak_mem_gb"] or 1),
                                   "resident_memory": (a["resident_gb"] or 0) / (b["resident_gb"] or 1)}
        if {"ours_nf4", "hf_bnb_liger"} <= set(ok):
            a, b = ok["ours_nf4"], ok["hf_bnb_liger"]
            rows["nf4_vs_bnb"] = {"speed": a["real_tokens_per_s"] / b["real_tokens_per_s"],
                                  "peak_memory": (a["peak_mem_gb"] or 0) / (b["peak_mem_gb"] or 1)}
        print(json.dumps({k: v for k, v in rows.items() if k.startswith("nf4_")}), flush=True)
    path = write_result(result_name("qlora_gpu" + ("_checkpointing" if args.checkpointing else ""), args), {
        "workload": "LoRA SFT r64 a128 on 7 projections (fp32 adapter), frozen weights bf16, bf16 autocast, "
                    "packed 8 x seq_len rows, skewed lengths, answer-only labels",
        "activation_checkpointing": args.checkpointing, "bnb_config": {**BNB, "bnb_4bit_compute_dtype": "bfloat16"}, "warmup_rule": WARMUP_RULE,
        "shapes": {s: SIZES[s] for s in sizes}, "seq_len": seq_len, "results": results})
    print("->", path)


if __name__ == "__main__":
    main()
