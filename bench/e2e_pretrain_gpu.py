"""End-to-end full-parameter pretraining step: our decoder vs transformers, same process (GPU).

Batch 8 × 2048 random tokens, one document per row (plain causal attention, no packing), loss on
every next token; fp32 master weights, bf16 autocast, fused AdamW (wd 0.1) on both sides.
Providers, all on the same token batches:
  hf_eager              LlamaForCausalLM (SDPA attention), no compile, model(ids, labels=ids).loss
  hf_compiled           torch.compile(model) of the same (the loss is inside forward, so compiled too)
  ours_reference        our Decoder, causal_lm_loss, kernels "reference"
  ours_fused            the same, kernels "auto" (fused Triton ops; q/k/v and gate/up stacked into one GEMM each)
  ours_fused_nostack    the same with q/k/v and gate/up one GEMM each (before 2026-12-04)
  ours_fused_unfusednorm  the same with the residual adds as their own ops and the norms in fp32 (before
                        2026-12-04 pm; bench.workloads.norms_fused)
  ours_fused_compiled   kernels "auto", the blocks compiled as the stages compile them with `compile: true`
                        (engine.compile.compiled_training: torch.compile(model.hidden_states), inside which "auto" takes
                        the torch reference ops for inductor to fuse; the loss head stays our fused Triton op, eager:
                        its label filter is data-dependent); a compile error is recorded
  ours_fused_cudagraphs the same compiled with mode="reduce-overhead": inductor's graphs replayed as CUDA graphs
                        (cudagraph trees, forward and backward), one launch per graph instead of one per kernel
  ours_fused_graphs     kernels "auto" eager, the blocks' forward and backward replayed as CUDA graphs as the stages
                        replay them with `cuda_graphs: true` (engine.cuda_graphs: our Triton kernels, no compile)
  ours_fused_autotune   the same with `compile: max-autotune` (mode "max-autotune-no-cudagraphs"): inductor times its
                        Triton GEMM templates against cuBLAS for each of the step's shapes and keeps the faster
  ours_*_cudnn          the same with SDPA's causal attention on cuDNN's kernels (torch.nn.attention.sdpa_kernel;
                        torch's own order puts FlashAttention-2 first)
MFU = tokens/s × (6·N_nonembedding + 12·L·h·seq) / 790e12, N_nonembedding without embed_tokens and
lm_head, 790 TFLOP/s = measured bf16 dense peak of the H200. `mfu_incl_lm_head` adds 6·h·V per token.

    python -m bench.e2e_pretrain_gpu [--sizes 125m,1b] [--steps 10 --warmup 3] [--smoke]
"""
from __future__ import annotations

import contextlib
import tempfile
from pathlib import Path

import torch

from glm_lora.kernels import ops as kernels
from bench.common import write_result
from bench.workloads import (precision_note, result_name, train_step, SIZES, autocast, decoder_config, guarded, hf_model, our_model, parser,
                             norms_fused, ratios, selected, setup, siblings_stacked, table, timed)
from glm_lora.engine.compile import compiled_training
from glm_lora.engine.cuda_graphs import graphed_training
from glm_lora.model.heads import causal_lm_loss
from glm_lora.engine.optim import build_optimizer
from glm_lora.model import DecoderConfig

PROVIDERS = ("hf_eager", "hf_compiled", "ours_reference", "ours_fused", "ours_fused_nostack", "ours_fused_unfusednorm",
             "ours_fused_compiled", "ours_fused_cudagraphs", "ours_fused_graphs", "ours_fused_autotune", "ours_fused_cudnn", "ours_fused_compiled_cudnn")
BASE = "hf_eager"
PEAK_FLOPS = 790e12
MFU_FORMULA = "tokens/s * (6*N_nonembedding + 12*L*h*seq) / 790e12; N_nonembedding excludes embed_tokens and lm_head"


def non_embedding_params(cfg: DecoderConfig) -> int:
    h, d = cfg.hidden_size, cfg.head_dim
    attn = h * cfg.num_heads * d * 2 + h * cfg.num_kv_heads * d * 2        # q, o + k, v
    return cfg.num_layers * (attn + 3 * h * cfg.intermediate_size + 2 * h) + h


def flops_per_token(cfg: DecoderConfig, seq_len: int) -> int:
    """The MFU numerator per token (MFU_FORMULA): 6·N_nonembedding + 12·L·h·seq."""
    return 6 * non_embedding_params(cfg) + 12 * cfg.num_layers * cfg.hidden_size * seq_len


def sdpa_backend(name: str | None):
    """A context running SDPA on one backend ("flash", "cudnn", "efficient"); None: torch's own choice."""
    if name is None:
        return contextlib.nullcontext()
    b = {"flash": "FLASH_ATTENTION", "cudnn": "CUDNN_ATTENTION", "efficient": "EFFICIENT_ATTENTION"}[name]
    return torch.nn.attention.sdpa_kernel(getattr(torch.nn.attention.SDPBackend, b))


def random_batches(n: int, rows: int, seq_len: int, vocab: int) -> list[dict]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        ids = torch.randint(3, vocab, (rows, seq_len), generator=g)
        out.append({"input_ids": ids, "labels": ids, "packed": False, "num_tokens": rows * seq_len,
                    "capacity": rows * seq_len, "target_positions": torch.arange(rows * (seq_len - 1))})
    return out


def run(name: str, cfg: DecoderConfig, batches: list[dict], args, device: torch.device) -> dict:
    setting = "max-autotune" if name.endswith("_autotune") else name.startswith("ours") and "compiled" in name
    if name.startswith("hf"):
        model = hf_model(cfg, device)
        fwd = torch.compile(model) if name.endswith("compiled") else model

        def loss_of(b):
            return fwd(input_ids=b["input_ids"], labels=b["labels"]).loss
    else:
        model = our_model(cfg, device)
        graphs = name.endswith("_cudagraphs")
        if graphs:
            model.hidden_states = torch.compile(model.hidden_states, mode="reduce-overhead")

        def loss_of(b):
            if graphs:      # a new step: the previous replay's outputs may be overwritten
                torch.compiler.cudagraph_mark_step_begin()
            return causal_lm_loss(model, b)[0]
    opt = build_optimizer(model, 3e-4, 0.1, fused=device.type == "cuda")
    params = sum(p.numel() for p in model.parameters())
    cudnn = sdpa_backend("cudnn" if name.endswith("_cudnn") else None)
    compiled = (compiled_training(model, setting, device=device, runs_dir=Path(tempfile.mkdtemp()), name=name)
                if setting else contextlib.nullcontext({}))
    replayed = graphed_training(model, name == "ours_fused_graphs", device=device, name=name)
    with kernels.using("reference" if name == "ours_reference" else "auto"), siblings_stacked(not name.endswith("_nostack")), \
            norms_fused(not name.endswith("_unfusednorm")), cudnn, compiled as info, replayed as graphs:
        out = {**timed(train_step(loss_of, opt, device), batches, args.warmup, device), "params": params}
    if info.get("compile_fallback") or info.get("compile_skipped") or graphs.get("cuda_graphs_fallback"):
        raise RuntimeError(f"{name}: ran eager: {info.get('compile_fallback') or info.get('compile_skipped') or graphs}")
    return out


def main() -> None:
    ap = parser(__doc__)
    ap.add_argument("--rows", type=int, default=8)
    args = ap.parse_args()
    sizes, device, vocab, seq_len = setup(args)
    batches = random_batches(args.warmup + args.steps, args.rows, seq_len, vocab)
    results, flops = {}, {}
    for size in sizes:
        cfg = decoder_config(size, vocab, seq_len)
        per_token = flops_per_token(cfg, seq_len)
        flops[size] = {"n_nonembedding": non_embedding_params(cfg), "flops_per_token": per_token,
                       "flops_per_token_incl_lm_head": per_token + 6 * cfg.hidden_size * vocab}
        rows = {}
        for p in selected(args, PROVIDERS):
            if args.smoke and ("compiled" in p or p.endswith(("_cudnn", "_cudagraphs", "_graphs", "_autotune"))):
                rows[p] = {"skipped": "--smoke: no compile, no cuDNN"}
                continue
            rows[p] = r = guarded(lambda: run(p, cfg, batches, args, device), device)
            if "real_tokens_per_s" in r:
                r["mfu"] = r["real_tokens_per_s"] * per_token / PEAK_FLOPS
                r["mfu_incl_lm_head"] = r["real_tokens_per_s"] * flops[size]["flops_per_token_incl_lm_head"] / PEAK_FLOPS
        ratios(rows, BASE)
        results[size] = rows
    table(results, [("real_tokens_per_s", "{:>9,.0f} tok/s"), ("mfu", "MFU {:.3f}"), ("step_ms", "{:7.1f} ms/step"),
                    ("peak_mem_gb", "peak {:5.1f} GB"), (f"tokens_per_s_vs_{BASE}", "{:5.2f}x tok/s"),
                    ("warmup_s", "warmup {:.0f} s")])
    figures = {"workload": f"full-parameter pretraining, {args.rows} x {seq_len} random tokens, causal, loss on all tokens",
               "precision": precision_note() if device.type == "cuda" else "fp32 (smoke, CPU)",
               "mfu_formula": MFU_FORMULA, "peak_flops": PEAK_FLOPS, "flops": flops,
               "shapes": {s: SIZES[s] for s in sizes}, "vocab": vocab, "seq_len": seq_len,
               "steps": args.steps, "warmup": args.warmup, "results": results}
    print("->", write_result(result_name("e2e_pretrain_gpu", args), figures))


if __name__ == "__main__":
    main()
